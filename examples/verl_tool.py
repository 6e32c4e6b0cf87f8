"""Tangram's verl tool, driven the way a verl rollout drives a tool: create -> execute -> reward -> release.

`tangram.integrations.verl.TangramSandboxTool` is a verl `BaseTool` (a subclass of verl's own when
verl is installed; this script needs neither verl nor a GPU). A scripted "model" inspects a small
buggy module in its sandbox, runs the tests (they fail: the tool returns the output and exit code
as text), fixes the bug with a second call (the sandbox keeps its files between calls), and the
reward comes from an elastic test run (`{dop}` worker processes, as many as the scheduler grants).

    tangram up
    python examples/verl_tool.py       # the client finds the local cluster (or: eval "$(tangram env)")

In a verl training run the same tool is named in the tool YAML (docs/integrations.md):

    tools:
      - class_name: tangram.integrations.verl.TangramSandboxTool
        config: {type: native, test_command: "python3 run_tests.py {dop}", reward: pytest}
"""

from __future__ import annotations

import argparse
import asyncio

from _calc_task import FILES  # examples/_calc_task.py (beside this script)

from tangram.integrations import verl

# The task a dataset row would carry in `extra_info.tools_kwargs.bash.create_kwargs`.
TASK = {"files": FILES}

# What the policy model "calls", one tool call per turn.
CALLS = [
    {"command": "cat calc.py"},
    {"command": "python3 run_tests.py 1"},
    {"command": "sed -i 's/a - b/a + b/' calc.py"},
    {"command": "python3 -c 'import calc; print(calc.add(2, 3))'"},
]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--addr", default=None, help="submit address (default: $TANGRAM_ADDR, then `tangram up`'s)"
    )
    args = ap.parse_args()
    config = {
        "type": "native",
        "addr": args.addr,
        "client_name": "verl-example",
        "timeout": 30,
        "test_command": "python3 run_tests.py {dop}",
        "test_cpus": [1, 4],
        "test_elastic": {1: 1.0, 2: 0.95, 4: 0.9},
        "test_duration_hint": 1.0,
        "test_timeout": 60,
        "reward": "pytest",
    }
    tool = verl.TangramSandboxTool(config, tool_schema=None)
    print(f"verl base: {verl.BASE}, tool {tool.name!r}")
    try:
        instance_id, _ = await tool.create(create_kwargs=TASK)
        print(f"reward before the fix: {await tool.calc_reward(instance_id):.2f}")
        for i, call in enumerate(CALLS, 1):
            response, _step_reward, _metrics = await tool.execute(instance_id, call)
            print(f"call {i} $ {call['command']}")
            print("  " + (response.text or "").replace("\n", "\n  "))
        reward = await tool.calc_reward(instance_id)
        run = tool.last_test_run(instance_id)
        assert run is not None
        print(f"reward after the fix: {reward:.2f} (test run on {run.dop} cores, {run.run_s:.2f}s)")
        await tool.release(instance_id)
        print("released")
    finally:
        await tool.aclose()


if __name__ == "__main__":
    asyncio.run(main())
