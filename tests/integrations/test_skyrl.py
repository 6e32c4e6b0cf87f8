"""`tangram.integrations.skyrl.TangramSandboxEnv` against a real local cluster (`tangram up`).

SkyRL's generator builds one env per trajectory (`skyrl_gym.make`), calls `init`, then `step` with
each LLM output until `done`, then `close`; the env's calls are synchronous and run on the
generator's event loop thread or in its env thread pool. Where skyrl-gym is installed the env
subclasses its `BaseTextEnv` and `skyrl_gym.make("tangram")` builds it; elsewhere the stand-in
base is checked.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tangram.errors import BadRequest, ConfigError, NoCapacity
from tangram.integrations import _skyrl_compat, skyrl

from .helpers import FILES, FIX, TEST_OPTIONS, sandboxes_of, wait_for

pytestmark = pytest.mark.timeout(120)
EXTRAS = {"extra_info": {"files": FILES}, "max_turns": 8}


def make_env(name: str, extras: dict[str, Any] | None = None, **overrides: Any) -> skyrl.TangramSandboxEnv:
    config = {"client_name": name, **TEST_OPTIONS, **overrides}
    return skyrl.TangramSandboxEnv(config, EXTRAS if extras is None else extras)


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    skyrl.close_shared_clients()


def content(out: dict[str, Any]) -> str:
    (message,) = out["observations"]
    assert message["role"] == "user"
    return message["content"]


# ---------------------------------------------------------------- the interface (no cluster)
def test_base_class_is_skyrl_gyms_when_it_imports() -> None:
    if importlib.util.find_spec("skyrl_gym") is None:
        assert skyrl.BASE == "fallback" and skyrl.IMPORT_ERROR
        assert issubclass(skyrl.TangramSandboxEnv, _skyrl_compat.BaseTextEnv)
        with pytest.raises(ImportError, match="skyrl-gym"):
            skyrl.register()
        return
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    assert skyrl.BASE == "skyrl_gym", skyrl.IMPORT_ERROR
    assert issubclass(skyrl.TangramSandboxEnv, BaseTextEnv)


@pytest.mark.skipif(skyrl.BASE != "skyrl_gym", reason="skyrl-gym is not installed")
def test_stand_in_has_skyrl_gyms_signatures() -> None:
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

    for method in ("init", "step", "close", "get_metrics", "aggregate_metrics"):
        real = list(inspect.signature(getattr(BaseTextEnv, method)).parameters)
        assert list(inspect.signature(getattr(_skyrl_compat.BaseTextEnv, method)).parameters) == real, method
    assert set(_skyrl_compat.BaseTextEnvStepOutput.__annotations__) == set(
        BaseTextEnvStepOutput.__annotations__
    )
    assert vars(_skyrl_compat.BaseTextEnv()) == vars(BaseTextEnv())  # turns, max_turns, tool groups


@pytest.mark.skipif(skyrl.BASE != "skyrl_gym", reason="skyrl-gym is not installed")
def test_skyrl_gym_make_builds_the_env() -> None:
    import skyrl_gym

    skyrl.register()
    env = skyrl_gym.make(skyrl.ENV_ID, env_config={"mem": "512MiB", "max_turns": 3}, extras={"max_turns": 5})
    assert isinstance(env, skyrl.TangramSandboxEnv)
    assert env.max_turns == 5 and env.options.mem == "512MiB"  # the sample's max_turns wins


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="test_comand"):
        make_env("typo", test_comand="pytest")
    with pytest.raises(ConfigError, match="command_tag"):
        make_env("bad", command_tag="<bash>")
    with pytest.raises(ConfigError, match="files"):
        make_env("bad", extras={"files": ["calc.py"]})


# ---------------------------------------------------------------- against the cluster
def test_episode_init_step_reward(cluster_home: Path) -> None:
    env = make_env("skyrl-episode")
    try:
        prompt = [{"role": "user", "content": "fix calc.add"}]
        assert env.init(prompt) == (prompt, {"sandbox": env.sandbox.id})  # type: ignore[union-attr]
        out = env.step("Look first.\n<bash>cat calc.py</bash>")
        assert content(out) == "def add(a, b):\n    return a - b"  # the sample's files are there
        assert out["reward"] == 0.0 and out["done"] is False and out["metadata"]["exit_code"] == 0
        out = env.step("<bash>mkdir -p w && echo hello > w/note.txt</bash>")
        assert content(out) == "(no output)"
        assert content(env.step("<bash>cat w/note.txt</bash>")) == "hello"  # state persists
        assert content(env.step("<bash>python3 run_tests.py 1</bash>")).endswith(
            "1 passed, 3 failed\n[exit code 1]"
        )  # a failing command is an observation, not an exception
        assert "<bash>" in content(env.step("I think I am done."))  # no command: the format hint
        env.step(f"<bash>{FIX}</bash>")
        out = env.step("Fixed it. <submit/>")
        assert out["done"] is True and out["observations"] == [] and out["reward"] == 1.0
        assert out["metadata"]["test_exit_code"] == 0 and out["metadata"]["test_dop"] in (1, 2)
        assert env.last_test is not None and f"workers={env.last_test.dop}" in env.last_test.stdout
        metrics = env.get_metrics()
        assert metrics["turns"] == 7 and metrics["commands"] == 5 and metrics["reward"] == 1.0
    finally:
        env.close()


def test_timeouts_and_turn_limit(cluster_home: Path) -> None:
    env = make_env("skyrl-limits", extras={**EXTRAS, "max_turns": 2}, timeout=1)
    try:
        env.init([])
        out = env.step("<bash>echo partial; sleep 30</bash>")
        assert content(out).startswith("partial\n[command timed out") and out["metadata"] == {
            "error": "timeout"
        }
        out = env.step("<bash>echo last</bash>")  # the turn limit: tests run, the episode ends
        assert out["done"] is True and out["reward"] == 0.25  # the bug is still there: 1 of 4
    finally:
        env.close()
    hang = make_env("skyrl-hang", extras={"test_command": "sleep 30"}, test_timeout=1)
    try:
        hang.init([])
        out = hang.step("<submit/>")
        assert out["done"] and out["reward"] == 0.0 and out["metadata"] == {"test_error": "timeout"}
    finally:
        hang.close()


def test_close_closes_the_sandbox(cluster_home: Path) -> None:
    name = "skyrl-close"
    env = make_env(name)
    env.init([])
    sandbox = env.sandbox
    assert sandbox is not None and sandboxes_of(cluster_home, name) == 1
    env.close()
    assert sandboxes_of(cluster_home, name) == 0
    with pytest.raises(BadRequest, match="closed|unknown sandbox"):  # the cluster refuses it
        sandbox.exec("true", timeout=10)
    env.close()  # twice: a no-op
    with pytest.raises(RuntimeError, match="closed"):
        env.step("<bash>ls</bash>")


def test_envs_run_where_skyrls_generator_calls_them(cluster_home: Path) -> None:
    """On the generator's event loop thread (max_env_workers=0) and in its env thread pool."""
    name = "skyrl-threads"

    def episode(i: int) -> float:
        env = make_env(name)
        try:
            env.init([])
            assert content(env.step(f"<bash>echo {i} > id; cat id</bash>")) == str(i)
            if i % 2:
                env.step(f"<bash>{FIX}</bash>")
            return env.step("<submit/>")["reward"]
        finally:
            env.close()

    async def generator() -> list[float]:
        loop = asyncio.get_running_loop()
        on_loop = episode(0)  # blocking on the loop thread: the client's own thread does the I/O
        with concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="skyrl-gym-env-") as pool:
            in_pool = await asyncio.gather(*(loop.run_in_executor(pool, episode, i) for i in range(1, 5)))
        return [on_loop, *in_pool]

    assert asyncio.run(generator()) == [0.25, 1.0, 0.25, 1.0, 0.25]
    options = make_env(name).options
    assert skyrl.shared_client(options) is skyrl.shared_client(options)  # one client for all envs
    assert wait_for(lambda: sandboxes_of(cluster_home, name) == 0)


def test_cluster_failures_raise(cluster_home: Path) -> None:
    env = make_env("skyrl-nocap", mem="60TiB")
    with pytest.raises(NoCapacity):
        env.init([])
    env.close()
