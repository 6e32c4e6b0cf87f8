"""A SkyRL-Gym environment backed by a Tangram sandbox: `TangramSandboxEnv`.

One environment is one trajectory, as SkyRL's generator uses it
(`skyrl_gym.make(env_class, env_config=..., extras=sample)`, then `init`, `step` until `done`,
`close`):

    init(prompt)   -> opens the sandbox and puts the sample's `files` in it; returns the prompt
    step(action)   -> runs the first <bash>...</bash> block of the LLM's output in the sandbox and
                      returns its output (and exit code) as a user message, reward 0.0; when the
                      output holds <submit/> (or the turn limit is reached) an elastic test run
                      (`{dop}` = granted cores) gives the reward and `done` is True
    close()        -> closes the sandbox (idempotent)

Sandbox state (files) persists between steps. What the model caused (a non-zero exit, a command
killed at its timeout, an answer without a command) is an observation, as SkyRL's own tool envs
report tool errors; failures of the cluster (no controller, no capacity, a lost sandbox) raise.

SkyRL-Gym's envs are synchronous and the generator may call them on its event loop thread or in
its env thread pool (`max_env_workers`); both work: the env uses the blocking `tangram.Client`,
whose own loop thread does the I/O, one client per process shared by all envs.

Configuration: the `tangram` section of SkyRL's `environment.skyrl_gym` config holds the options
of `tangram.integrations._common`, plus `command_tag` ("bash"), `submit_tag` ("submit") and
`max_turns` (8; the sample's `max_turns`, which SkyRL's generator sets, wins). Per sample, the
`extras` (or their `extra_info`) may hold `files` and `test_command`. `register()` registers the
env with SkyRL-Gym as "tangram". With skyrl-gym installed the env subclasses
`skyrl_gym.envs.base_text_env.BaseTextEnv` (`BASE == "skyrl_gym"`), otherwise plain-Python
stand-ins with the same signatures (`BASE == "fallback"`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

from tangram.client.aio import ExecResult
from tangram.client.sync import Client, Sandbox
from tangram.errors import ActionTimeout, ConfigError
from tangram.integrations import _common as common

log = logging.getLogger(__name__)

try:
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

    BASE = "skyrl_gym"
    IMPORT_ERROR: str | None = None
except ImportError as exc:
    from tangram.integrations._skyrl_compat import BaseTextEnv, BaseTextEnvStepOutput

    BASE = "fallback"
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    if (getattr(exc, "name", None) or "").split(".")[0] != "skyrl_gym":
        log.warning("skyrl_gym is installed but does not import (%s); using the stand-in base", IMPORT_ERROR)

__all__ = ["BASE", "ENV_ID", "TangramSandboxEnv", "close_shared_clients", "register", "shared_client"]

ENV_ID = "tangram"
DEFAULT_MAX_TURNS = 8
_CLIENTS: dict[tuple[int, str | None, str, float], Client] = {}
_CLIENTS_LOCK = threading.Lock()


def shared_client(options: common.Options) -> Client:
    """The process's client for these options (built on first use, rebuilt after a fork)."""
    key = (os.getpid(), options.addr, options.client_name, options.connect_timeout)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = Client(options.addr, name=options.client_name, connect_timeout=options.connect_timeout)
            _CLIENTS[key] = client
        return client


def close_shared_clients() -> None:
    """Close this process's shared clients (and with them, on the controller, their sandboxes)."""
    with _CLIENTS_LOCK:
        mine = [k for k in _CLIENTS if k[0] == os.getpid()]
        clients = [_CLIENTS.pop(k) for k in mine]
    for client in clients:
        client.close()


def register(env_id: str = ENV_ID) -> None:
    """Register `TangramSandboxEnv` with SkyRL-Gym, so `skyrl_gym.make(env_id, ...)` builds it."""
    if BASE != "skyrl_gym":
        raise ImportError(f"skyrl_gym does not import ({IMPORT_ERROR}): pip install skyrl-gym")
    from skyrl_gym.envs import register as skyrl_register  # optional dependency, checked above

    skyrl_register(id=env_id, entry_point=f"{__name__}:TangramSandboxEnv")


def _tag(raw: dict[str, Any], key: str, default: str) -> str:
    tag = raw.pop(key, default)
    if not isinstance(tag, str) or not re.fullmatch(r"[A-Za-z_][\w-]*", tag):
        raise ConfigError(f"{key} must be a tag name such as {default!r}, got {tag!r}")
    return tag


class TangramSandboxEnv(BaseTextEnv):
    """SkyRL-Gym `BaseTextEnv` over one Tangram sandbox per trajectory."""

    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None):
        super().__init__()
        raw = dict(common.plain(env_config or {}))
        command_tag = _tag(raw, "command_tag", "bash")
        submit_tag = _tag(raw, "submit_tag", "submit")
        default_turns = raw.pop("max_turns", DEFAULT_MAX_TURNS)
        self.options = common.Options.from_mapping(raw, default_name="skyrl-env")
        sample = dict(common.plain(extras or {}))
        info = sample.get("extra_info")
        self.task = common.Task.from_mapping({**(info if isinstance(info, dict) else {}), **sample})
        self.max_turns = int(sample.get("max_turns") or default_turns)
        self._command = re.compile(rf"<{command_tag}>(.*?)</{command_tag}>", re.DOTALL)
        self._submit = re.compile(rf"<{submit_tag}\s*/?>")
        self.hint = (
            f"No command found: put one shell command in <{command_tag}>...</{command_tag}>, "
            f"or finish with <{submit_tag}/>."
        )
        self.sandbox: Sandbox | None = None
        self.commands = 0
        self.reward = 0.0
        self.last_test: ExecResult | None = None
        self._closed = False

    # ------------------------------------------------------------ SkyRL-Gym's interface
    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        sandbox = self._sandbox()
        return prompt, {"sandbox": sandbox.id}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        submitted = bool(self._submit.search(action))
        match = self._command.search(action)
        text, metadata = self.hint, {}
        if match is not None:
            text, metadata = self._run(match.group(1).strip())
        if submitted or self.turns >= self.max_turns:
            self.reward, test_metadata = self._run_tests()
            return BaseTextEnvStepOutput(
                observations=[], reward=self.reward, done=True, metadata={**metadata, **test_metadata}
            )
        return BaseTextEnvStepOutput(
            observations=[{"role": "user", "content": text}], reward=0.0, done=False, metadata=metadata
        )

    def close(self) -> None:
        self._closed = True
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            sandbox.close()

    def get_metrics(self) -> dict[str, Any]:
        metrics: dict[str, Any] = {"turns": self.turns, "commands": self.commands, "reward": self.reward}
        if self.last_test is not None:
            metrics.update(test_dop=self.last_test.dop, test_run_s=self.last_test.run_s)
        return metrics

    # ------------------------------------------------------------ plumbing
    def _sandbox(self) -> Sandbox:
        if self._closed:
            raise RuntimeError("the environment is closed")
        if self.sandbox is None:
            sandbox = shared_client(self.options).sandbox(self.options.image, self.options.mem)
            try:
                for path, data in self.task.files.items():
                    sandbox.put(path, data)
            except BaseException:
                sandbox.close()
                raise
            self.sandbox = sandbox
        return self.sandbox

    def _run(self, command: str) -> tuple[str, dict[str, Any]]:
        if not command:
            return self.hint, {"error": "empty_command"}
        sandbox, opts = self._sandbox(), self.options
        self.commands += 1
        try:
            result = sandbox.exec(command, cpus=opts.cpus, timeout=opts.timeout)
        except ActionTimeout as exc:
            return common.render_timeout(exc, opts.max_output_chars), {"error": "timeout"}
        return common.render(result, opts.max_output_chars), common.exec_metrics(result)

    def _run_tests(self) -> tuple[float, dict[str, Any]]:
        test = self.task.test_run(self.options)
        if test is None:
            return 0.0, {}
        try:
            result = self._sandbox().exec(test.command, **test.exec_kwargs())
        except ActionTimeout:  # the model's code hangs the tests: no reward, not an error
            return 0.0, {"test_error": "timeout"}
        self.last_test = result
        return common.score(result, test.reward), {
            "test_exit_code": result.exit_code,
            "test_dop": result.dop,
            "test_run_s": result.run_s,
        }
