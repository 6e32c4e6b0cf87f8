"""The controller's durable state: what must survive a controller crash, and its replay.

The scheduler's own state (queues, cores, GPU residency) is rebuilt from the world after a
restart: agents say Hello again, clients resend what they wait for. What the world cannot
tell a new controller is kept here, in an append-only file (one JSON object per line, the
canonical encoding of `tangram.journal`, a header line per controller epoch):

    {"journal":"tangram-state","version":1,"epoch":E,"t":WALL}
    {"f":"open","sb":S,"ident":HEX,"image":I,"mem":M,"reserve":R}   a sandbox opened
    {"f":"node","sb":S,"node":N}                                     ... placed on a node
    {"f":"gone","sb":S}                                              ... closed or lost
    {"f":"run","ident":HEX,"rid":R,"kind":K,"node":N,"action":A}    a request started running
    {"f":"ans","ident":HEX,"rid":R,"kind":K,"t":WALL,"frames":[B64]} its one final reply
    {"f":"lease","action":A,"api":API,"units":U,"ident":HEX,"rid":R,"expires":WALL}  granted
        (+ "key":K, "t":WALL, "tok":N for a key pool's lease: the key's name, never its
        secret, and its charge: granted at t, N tokens)
    {"f":"lease-end","action":A}                                     ... released or expired
    {"f":"tok","action":A,"tok":N}                                   its holder reported N tokens
    {"f":"cool","api":API,"key":K,"until":WALL}                      a key cools down (a 429)
    {"f":"keys","api":API,"key":K,"cool":WALL,"charges":[[A,T,U,N]]}  a key's minute (rewrites)
    {"f":"quota","api":API,"used":U,"start":WALL}                    a quota window's use
    {"f":"up","node":N} / {"f":"down","node":N}                      a node joined / left

Write policy: a line reaches the OS (one `write`, O_APPEND) before the message it guards is
sent: a `run` before the Spawn/Invoke, an `ans` before the client's reply. A killed controller
therefore never forgets that something ran or what it answered. `fsync` runs at most every
`SYNC_S` seconds and at a clean stop, so a machine crash can lose the last second.

Replay (`load`): live sandboxes with their nodes, leases not yet released (with the key each
holds), each API's last quota window, each key's charges of the last `KEY_WINDOW_S` and its
cool-down, answers younger than `ANSWER_TTL_S`, and requests that ran without an answer
(after a restart they are answered NODE_LOST: they were stopped, never run twice). Start-up
rewrites the file with just that (compaction; a key's charges pruned to the last minute), and
so does `append` once the file passes `COMPACT_BYTES`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tangram import journal
from tangram.core.managers.keys import WINDOW_S
from tangram_cli.controller.api_keys import scrub

log = logging.getLogger("tangram.controller.ledger")

VERSION = 1
ANSWER_TTL_S = 300.0  # as long as the reply cache keeps a final reply
SYNC_S = 1.0
COMPACT_BYTES = 64 << 20
MAX_ANSWER_BYTES = 1 << 20  # a larger final reply is kept as "finished, result not kept"
ANSWERS_MAX = 65536  # as many as the reply cache holds
KINDS = frozenset({"open", "exec", "call", "lease"})  # requests whose effect must not repeat
KEY_WINDOW_S = WINDOW_S  # a key's charges older than this no longer count (managers/keys.py)


@dataclass
class SandboxFact:
    sandbox: str
    ident: bytes
    image: str
    mem_mib: int
    reserve: int
    node: str = ""


@dataclass
class LeaseFact:
    action: str
    api: str
    units: int
    ident: bytes
    rid: int
    expires: float  # wall clock
    key: str = ""  # the key (name) of an API key pool it holds


@dataclass
class ChargeFact:
    """One lease's charge against its key's minute (API key pools)."""

    api: str
    key: str
    t: float  # wall clock of the grant
    units: int
    tokens: int


@dataclass
class Restored:
    """What a controller finds in the file it starts with."""

    sandboxes: dict[str, SandboxFact] = field(default_factory=dict)
    answers: dict[tuple[bytes, int], tuple[str, float, list[bytes] | None]] = field(default_factory=dict)
    # ran without an answer -> (kind, node, action)
    ran: dict[tuple[bytes, int], tuple[str, str, str]] = field(default_factory=dict)
    leases: dict[str, LeaseFact] = field(default_factory=dict)
    quotas: dict[str, tuple[int, float]] = field(default_factory=dict)  # api -> (used, window start, wall)
    charges: dict[str, ChargeFact] = field(default_factory=dict)  # lease -> its key's charge, in time order
    cools: dict[tuple[str, str], float] = field(default_factory=dict)  # (api, key) -> cooling until, wall
    nodes: set[str] = field(default_factory=set)  # the nodes that were up
    epochs: int = 0
    skipped: int = 0  # lines that did not parse (a torn last line)

    @property
    def empty(self) -> bool:
        return not (
            self.sandboxes
            or self.answers
            or self.ran
            or self.leases
            or self.quotas
            or self.nodes
            or self.charges
            or self.cools
        )


def _apply(r: Restored, rec: dict[str, Any], now: float) -> None:
    f = rec.get("f")
    if f == "open":
        s = SandboxFact(rec["sb"], bytes.fromhex(rec["ident"]), rec["image"], rec["mem"], rec["reserve"])
        r.sandboxes[s.sandbox] = s
    elif f == "node":
        if (s2 := r.sandboxes.get(rec["sb"])) is not None:
            s2.node = rec["node"]
    elif f == "gone":
        r.sandboxes.pop(rec["sb"], None)
    elif f == "run":
        r.ran[(bytes.fromhex(rec["ident"]), rec["rid"])] = (
            rec["kind"],
            rec.get("node", ""),
            rec.get("action", ""),
        )
    elif f == "lease":
        lf = LeaseFact(
            rec["action"],
            rec["api"],
            rec["units"],
            bytes.fromhex(rec["ident"]),
            rec["rid"],
            rec["expires"],
            rec.get("key", ""),
        )
        r.leases[lf.action] = lf
        if lf.key and "t" in rec:
            r.charges[lf.action] = ChargeFact(lf.api, lf.key, rec["t"], lf.units, rec["tok"])
    elif f == "lease-end":
        r.leases.pop(rec["action"], None)
    elif f in ("tok", "cool", "keys"):
        _apply_key(r, rec)
    elif f == "up":
        r.nodes.add(rec["node"])
    elif f == "down":
        r.nodes.discard(rec["node"])
    elif f == "quota":
        r.quotas[rec["api"]] = (rec["used"], rec["start"])
    elif f == "ans":
        key = (bytes.fromhex(rec["ident"]), rec["rid"])
        r.ran.pop(key, None)
        if now - rec["t"] < ANSWER_TTL_S:
            frames = None if rec["frames"] is None else [base64.b64decode(x) for x in rec["frames"]]
            r.answers[key] = (rec["kind"], rec["t"], frames)
        else:
            r.answers.pop(key, None)


def _apply_key(r: Restored, rec: dict[str, Any]) -> None:
    """The key-pool lines: a token report, a cool-down, a key's minute as a rewrite left it."""
    f = rec["f"]
    if f == "tok":
        if (c := r.charges.get(rec["action"])) is not None:
            c.tokens = int(rec["tok"])
    elif f == "cool":
        k = (rec["api"], rec["key"])
        r.cools[k] = max(r.cools.get(k, 0.0), float(rec["until"]))
    else:
        k = (rec["api"], rec["key"])
        if rec.get("cool"):
            r.cools[k] = max(r.cools.get(k, 0.0), float(rec["cool"]))
        for action, t, units, tokens in rec["charges"]:
            r.charges[action] = ChargeFact(k[0], k[1], float(t), int(units), int(tokens))


def load(path: str, now: float | None = None) -> Restored:
    """Replay ``path`` (missing: nothing). Unparsable lines are skipped and counted."""
    now = time.time() if now is None else now
    r = Restored()
    try:
        fh = open(path, encoding="ascii", errors="replace")
    except FileNotFoundError:
        return r
    with fh:
        for line in fh:
            try:
                rec = json.loads(line)
                if rec.get("journal") == "tangram-state":
                    r.epochs += 1
                    continue
                _apply(r, rec, now)
            except (ValueError, KeyError, TypeError, AttributeError):
                r.skipped += 1
    live = sorted((c.t, a) for a, c in r.charges.items() if c.t > now - KEY_WINDOW_S)
    r.charges = {a: r.charges[a] for _, a in live}
    r.cools = {k: t for k, t in r.cools.items() if t > now}
    return r


class Ledger:
    """Appends facts to the state file (one owner: the controller); `path` None keeps nothing."""

    def __init__(self, path: str | None, epoch: int, wall: Callable[[], float] = time.time) -> None:
        self.path = path
        self.epoch = epoch
        self.wall = wall
        self._fd = -1
        self._size = 0
        self._synced = 0.0
        self._dirty = False
        # the live facts, for compaction: sandbox -> its lines; (ident, rid) -> its run/ans line
        self._sandboxes: dict[str, list[str]] = {}
        self._requests: OrderedDict[tuple[bytes, int], str] = OrderedDict()
        self._leases: dict[str, str] = {}
        self._quotas: dict[str, str] = {}
        self._charges: OrderedDict[str, ChargeFact] = OrderedDict()  # lease -> charge, grant order
        self._cools: dict[tuple[str, str], float] = {}  # (api, key) -> cooling until, wall
        self._nodes: set[str] = set()
        self.written = 0

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def restore(self) -> Restored:
        """Read the file, rewrite it compacted under a new epoch header, keep it open to append."""
        if self.path is None:
            return Restored()
        r = load(self.path, self.wall())
        for s in r.sandboxes.values():
            self.opened(s.sandbox, s.ident, s.image, s.mem_mib, s.reserve, write=False)
            if s.node:
                self.placed(s.sandbox, s.node, write=False)
        for key, (kind, t, frames) in r.answers.items():
            self._requests[key] = self._ans_line(key, kind, t, frames)
        for key, (kind, node, action) in r.ran.items():
            self._requests[key] = _run_line(key, kind, node, action)
        for api, (used, start) in r.quotas.items():
            self.quota(api, used, start, write=False)
        self._charges.update(r.charges)  # leases granted again keep their charge (`lease`)
        self._cools.update(r.cools)
        self._nodes = set(r.nodes)  # they stay expected until they join again or are given up
        # leases are written again when the restored controller grants them anew
        self._rewrite()
        return r

    # ------------------------------------------------------------ facts
    def opened(
        self, sandbox: str, ident: bytes, image: str, mem_mib: int, reserve: int, write: bool = True
    ) -> None:
        if self.path is None:
            return
        line = _line(
            {
                "f": "open",
                "sb": sandbox,
                "ident": ident.hex(),
                "image": image,
                "mem": mem_mib,
                "reserve": reserve,
            }
        )
        self._sandboxes[sandbox] = [line]
        if write:
            self._append(line)

    def placed(self, sandbox: str, node: str, write: bool = True) -> None:
        lines = self._sandboxes.get(sandbox)
        if lines is None:
            return
        line = _line({"f": "node", "sb": sandbox, "node": node})
        lines[1:] = [line]
        if write:
            self._append(line)

    def gone(self, sandboxes: Sequence[str]) -> None:
        for sandbox in sandboxes:
            if self._sandboxes.pop(sandbox, None) is not None:
                self._append(_line({"f": "gone", "sb": sandbox}))

    def lease(self, lf: LeaseFact, charge: ChargeFact | None = None) -> None:
        """A granted lease; ``charge``: its charge against its key's minute (a key pool's)."""
        if self.path is None:
            return
        doc: dict[str, Any] = {
            "f": "lease",
            "action": lf.action,
            "api": lf.api,
            "units": lf.units,
            "ident": lf.ident.hex(),
            "rid": lf.rid,
            "expires": lf.expires,
        }
        if lf.key:
            doc["key"] = lf.key
        if lf.key and charge is not None:
            doc.update(t=charge.t, tok=charge.tokens)
            self._charges[lf.action] = charge
            self._prune(self.wall())
        line = _line(doc)
        self._leases[lf.action] = line
        self._append(line)

    def charged(self, action: str, tokens: int) -> None:
        """A lease's holder reported ``tokens``: its charge changes (while it is in the window)."""
        c = self._charges.get(action)
        if c is not None and c.tokens != tokens:
            c.tokens = tokens
            self._append(_line({"f": "tok", "action": action, "tok": tokens}))

    def cooled(self, api: str, key: str, until: float) -> None:
        """Key ``key`` of ``api`` cools down until ``until`` (wall clock) after a rate-limit answer."""
        if self.path is None or until <= self._cools.get((api, key), 0.0):
            return
        self._cools[(api, key)] = until
        self._append(_line({"f": "cool", "api": api, "key": key, "until": until}))

    def _prune(self, now: float) -> None:
        while self._charges and next(iter(self._charges.values())).t <= now - KEY_WINDOW_S:
            self._charges.popitem(last=False)
        self._cools = {k: t for k, t in self._cools.items() if t > now}

    def _key_lines(self, now: float) -> list[str]:
        """Each key's charges of the last minute and its cool-down, one line per key."""
        self._prune(now)
        rows: dict[tuple[str, str], list[list[Any]]] = {}
        for action, c in self._charges.items():
            rows.setdefault((c.api, c.key), []).append([action, c.t, c.units, c.tokens])
        lines = []
        for api, key in sorted(set(rows) | set(self._cools)):
            cool, charges = self._cools.get((api, key), 0.0), rows.get((api, key), [])
            lines.append(_line({"f": "keys", "api": api, "key": key, "cool": cool, "charges": charges}))
        return lines

    def lease_end(self, action: str) -> None:
        if self._leases.pop(action, None) is not None:
            self._append(_line({"f": "lease-end", "action": action}))

    def holds_lease(self, action: str) -> bool:
        return action in self._leases

    def quota(self, api: str, used: int, start: float, write: bool = True) -> None:
        if self.path is None:
            return
        line = _line({"f": "quota", "api": api, "used": used, "start": start})
        self._quotas[api] = line
        if write:
            self._append(line)

    def node(self, node: str, up: bool) -> None:
        if self.path is None or (node in self._nodes) == up:
            return
        (self._nodes.add if up else self._nodes.discard)(node)
        self._append(_line({"f": "up" if up else "down", "node": node}))

    def ran(self, ident: bytes, rid: int, kind: str, node: str = "", action: str = "") -> None:
        if self.path is None:
            return
        line = _run_line((ident, rid), kind, node, action)
        self._remember((ident, rid), line)
        self._append(line)

    def answered(self, ident: bytes, rid: int, kind: str, frames: list[bytes]) -> None:
        if self.path is None or kind not in KINDS:
            return
        if kind == "lease":
            frames = scrub(frames)  # an API key's secret never goes to disk (api_keys.py)
        line = self._ans_line((ident, rid), kind, self.wall(), frames)
        self._remember((ident, rid), line)
        self._append(line)

    def _ans_line(self, key: tuple[bytes, int], kind: str, t: float, frames: list[bytes] | None) -> str:
        if frames is not None and sum(len(f) for f in frames) > MAX_ANSWER_BYTES:
            frames = None
        coded = None if frames is None else [base64.b64encode(f).decode("ascii") for f in frames]
        return _line(
            {"f": "ans", "ident": key[0].hex(), "rid": key[1], "kind": kind, "t": t, "frames": coded}
        )

    def _remember(self, key: tuple[bytes, int], line: str) -> None:
        self._requests[key] = line
        self._requests.move_to_end(key)
        while len(self._requests) > ANSWERS_MAX:
            self._requests.popitem(last=False)

    # ------------------------------------------------------------ the file
    def _append(self, line: str) -> None:
        if self._fd < 0:
            return
        data = (line + "\n").encode("ascii")
        try:
            os.write(self._fd, data)
        except OSError as exc:  # a full disk must not stop the controller: say so, keep serving
            log.error(
                "state file %s: write failed (%s); a restart now would lose recent state", self.path, exc
            )
            return
        self.written += 1
        self._size += len(data)
        self._dirty = True
        if self._size > COMPACT_BYTES:
            self._rewrite()

    def _rewrite(self) -> None:
        """Write the live facts to a new file under a new header, fsync, rename over the old one."""
        assert self.path is not None
        header = journal.dumps(
            {
                "journal": "tangram-state",
                "version": VERSION,
                "epoch": self.epoch,
                "t": journal.encode(self.wall()),
            }
        )
        now = self.wall()
        lines = [header]
        for sb_lines in self._sandboxes.values():
            lines.extend(sb_lines)
        lines.extend(self._leases.values())
        lines.extend(self._quotas.values())
        lines.extend(self._key_lines(now))
        lines.extend(_line({"f": "up", "node": n}) for n in sorted(self._nodes))
        lines.extend(self._requests.values())
        data = ("\n".join(lines) + "\n").encode("ascii")
        tmp = f"{self.path}.tmp{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._size, self._synced, self._dirty = len(data), now, False

    def sync(self, force: bool = False) -> None:
        """fsync if something was written and `SYNC_S` passed (or `force`)."""
        if self._fd < 0 or not self._dirty:
            return
        now = self.wall()
        if force or now - self._synced >= SYNC_S:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
            self._synced, self._dirty = now, False

    def close(self) -> None:
        if self._fd >= 0:
            self.sync(force=True)
            os.close(self._fd)
            self._fd = -1


def _line(doc: dict[str, Any]) -> str:
    return journal.dumps(doc)


def _run_line(key: tuple[bytes, int], kind: str, node: str, action: str) -> str:
    return _line(
        {"f": "run", "ident": key[0].hex(), "rid": key[1], "kind": kind, "node": node, "action": action}
    )
