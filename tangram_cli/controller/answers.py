"""The core's verdicts on actions, turned into each request's final reply.

`Grant` (an API lease), `Reserve` (a sandbox opened with reserved cores), `Reject` (queued too
long, no capacity, node lost...) and `Done` (an exec or call finished, failed, was cancelled
or timed out) each end one request: the gateway answers it with `Result` or `Error` through
`final` (rule 1 of `gateway.py`). An exec's or call's `Result` is the agent's typed outcome plus
what only the controller knows (queueing, overhead, node, cores or GPUs).

`Gateway` inherits these methods; they use its registry, clock, `post` and `final`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tangram import protocol
from tangram.core import commands as cmd
from tangram.core import events as ev
from tangram.outcomes import CallOutcome, ExecOutcome
from tangram_cli.controller.api_keys import lease_fields
from tangram_cli.controller.state import ActionRecord, Registry

KILL_CODES = {"timeout": "TIMEOUT"}


class Answers:
    """Mixed into `Gateway` (which provides the attributes below)."""

    clock: Any
    config: Any
    registry: Registry
    post: Callable[..., None]
    final: Callable[..., None]
    _release_action: Callable[[str], None]

    def on_grant(self, c: cmd.Grant) -> None:
        rec = self.registry.actions.get(c.action_id)
        if rec is None or rec.final_sent:
            return
        rec.granted, rec.final_sent, rec.started = True, True, self.clock.now()
        self.registry.record_wait(rec.started - rec.submitted)
        self.final(
            rec.ident,
            rec.request_id,
            protocol.Result(
                {
                    "lease": c.action_id,
                    "api": c.api,
                    "units": rec.units,
                    "expires_in_s": round(max(0.0, rec.deadline - self.clock.now()), 3),
                    "queued_s": round(rec.started - rec.submitted, 6),
                    **lease_fields(self.config, c),  # an API key pool's key: its secret goes only here
                }
            ),
        )

    def on_reserve(self, c: cmd.Reserve) -> None:
        rec = self.registry.actions.get(c.action_id)
        if rec is None or rec.final_sent:
            return
        rec.final_sent = True
        self.final(
            rec.ident,
            rec.request_id,
            protocol.Result({"sandbox": c.sandbox, "node": c.node, "cores": list(c.cores)}),
        )

    def on_reject(self, c: cmd.Reject) -> None:
        rec = self.registry.actions.get(c.action_id)
        if rec is None:
            return
        code = c.code
        if rec.kind == "lease" and code == "TIMEOUT" and not rec.granted:
            code = "QUOTA_EXCEEDED"
        if rec.kind == "open":
            sb = self.registry.sandboxes.get(rec.sandbox)
            if sb is not None and not sb.closed:
                sb.closed = True
                self.post(ev.SandboxClosed(rec.sandbox))
        if rec.release is not None:
            ident, rid = rec.release
            rec.release = None
            self.final(ident, rid, protocol.Result({}))
        if rec.final_sent:
            self.registry.actions.pop(c.action_id, None)
            self._release_action(c.action_id)
            return
        rec.final_sent = True
        detail = "\n".join(str(r) for r in c.reasons)
        retryable = code in ("TIMEOUT", "QUOTA_EXCEEDED", "NODE_LOST", "RETRY_LATER")
        self.final(
            rec.ident, rec.request_id, protocol.Error(code, c.message[: protocol.MAX_TEXT], retryable, detail)
        )
        self.registry.actions.pop(c.action_id, None)
        self._release_action(c.action_id)

    def on_done(self, c: cmd.Done) -> None:
        rec = self.registry.actions.pop(c.action_id, None)
        if rec is None:
            return
        self._release_action(c.action_id)
        if rec.release is not None:
            ident, rid = rec.release
            self.final(ident, rid, protocol.Result({}))
        if rec.final_sent:
            return
        rec.final_sent = True
        out = rec.outcome
        res = out.result if out is not None and out.error is None else None
        ran_to_exit = isinstance(res, ExecOutcome) and not res.killed and not res.timed_out
        if rec.kill_reason and not ran_to_exit:
            code = KILL_CODES.get(rec.kill_reason, "CANCELLED")
            msg = (
                "timed out: the action ran past its timeout and was killed"
                if code == "TIMEOUT"
                else f"cancelled ({rec.kill_reason})"
            )
            timed_out_exec = code == "TIMEOUT" and rec.kind == "exec" and out is not None
            partial = list(out.blobs[:2]) if timed_out_exec else []  # type: ignore[union-attr]  # output so far
            self.final(rec.ident, rec.request_id, protocol.Error(code, msg, code == "TIMEOUT"), partial)
            return
        if out is not None and out.error is not None:
            self.final(rec.ident, rec.request_id, out.error)
            return
        if res is None:
            self.final(
                rec.ident,
                rec.request_id,
                protocol.Error("INTERNAL", f"action ended without a result ({c.reason})", False),
            )
            return
        if isinstance(res, ExecOutcome) and res.timed_out:
            why = f"timed out: killed on the node after {res.run_s:.3g} s of running (its timeout)"
            partial = list(out.blobs[:2])  # type: ignore[union-attr]  # the output so far
            self.final(rec.ident, rec.request_id, protocol.Error("TIMEOUT", why, True), partial)
            return
        self._send_outcome(rec, res, out.blobs)  # type: ignore[union-attr]

    def _send_outcome(
        self, rec: ActionRecord, res: ExecOutcome | CallOutcome, blobs: tuple[bytes, ...]
    ) -> None:
        """The client's final Result: the agent's outcome plus what only the controller knows."""
        started = rec.started or rec.submitted
        # a staged start (tangram/core/staging.py) waited on the agent for its cores: queueing too
        queued = max(0.0, started - rec.submitted) + (res.waited_s if isinstance(res, ExecOutcome) else 0.0)
        total = self.clock.now() - rec.submitted
        timing = {
            "queued_s": round(queued, 6),
            "run_s": round(res.run_s, 6),
            "overhead_s": round(max(0.0, total - queued - res.run_s), 6),
            "node": rec.node,
            "action": rec.action_id,
        }
        if isinstance(res, ExecOutcome):
            body = res.to_body(cores=list(rec.cores), dop=rec.dop, **timing)
            self.final(rec.ident, rec.request_id, protocol.Result(body), list(blobs[:2]), True)
        else:
            body = res.to_body(gpus=list(rec.gpus), loaded=rec.loaded, **timing)
            self.final(rec.ident, rec.request_id, protocol.Result(body), list(blobs[:1]), True)
