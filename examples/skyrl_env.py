"""Tangram's SkyRL-Gym environment, driven the way SkyRL's generator drives an env: init -> step... -> close.

`tangram.integrations.skyrl.TangramSandboxEnv` is a SkyRL-Gym `BaseTextEnv` (a subclass of
skyrl-gym's own when it is installed; then it is built with `skyrl_gym.make("tangram", ...)`, as
the generator does). Scripted "LLM outputs" look at a small buggy module in the trajectory's
sandbox, run its tests (they fail: the observation holds the output and exit code), fix the bug
(files persist between steps) and submit; the reward comes from an elastic test run (`{dop}`
worker processes, as many as the scheduler grants).

    tangram up
    python examples/skyrl_env.py       # the client finds the local cluster (or: eval "$(tangram env)")
"""

from __future__ import annotations

import argparse
from typing import Any

from _calc_task import FILES  # examples/_calc_task.py (beside this script)

from tangram.integrations import skyrl

# One dataset row's extras (SkyRL passes them to the env; the generator adds max_turns).
EXTRAS = {
    "extra_info": {"files": FILES},
    "max_turns": 6,
}
ACTIONS = [
    "Let me look at the code first.\n<bash>cat calc.py</bash>",
    "<bash>python3 run_tests.py 1</bash>",
    "The sign is wrong.\n<bash>sed -i 's/a - b/a + b/' calc.py</bash>",
    "Fixed. <submit/>",
]


def make_env(config: dict[str, Any]) -> skyrl.TangramSandboxEnv:
    if skyrl.BASE == "skyrl_gym":  # as SkyRL's generator builds it
        import skyrl_gym

        skyrl.register()
        return skyrl_gym.make(skyrl.ENV_ID, env_config=config, extras=EXTRAS)
    return skyrl.TangramSandboxEnv(config, EXTRAS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--addr", default=None, help="submit address (default: $TANGRAM_ADDR, then `tangram up`'s)"
    )
    args = ap.parse_args()
    config = {
        "addr": args.addr,
        "client_name": "skyrl-example",
        "timeout": 30,
        "test_command": "python3 run_tests.py {dop}",
        "test_cpus": [1, 4],
        "test_elastic": {1: 1.0, 2: 0.95, 4: 0.9},
        "test_duration_hint": 1.0,
        "reward": "pytest",
    }
    env = make_env(config)
    print(f"skyrl-gym base: {skyrl.BASE}")
    try:
        _prompt, info = env.init([{"role": "user", "content": "Fix calc.add so the tests pass."}])
        print(f"init: sandbox {info['sandbox']}")
        for action in ACTIONS:
            out = env.step(action)
            if out["done"]:
                print(
                    f"done after {env.turns} turns: reward {out['reward']:.2f}, "
                    f"test run on {out['metadata']['test_dop']} cores"
                )
                break
            print(f"turn {env.turns}: " + out["observations"][0]["content"].replace("\n", "\n  "))
        print("metrics:", env.get_metrics())
    finally:
        env.close()
        skyrl.close_shared_clients()
    print("closed")


if __name__ == "__main__":
    main()
