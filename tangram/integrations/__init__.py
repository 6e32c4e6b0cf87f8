"""Adapters that let RL frameworks run their tools and environments on a Tangram cluster.

- `tangram.integrations.verl`: `TangramSandboxTool`, a verl `BaseTool` (create / execute /
  calc_reward / release -> sandbox open / exec / elastic test run / close).
- `tangram.integrations.skyrl`: `TangramSandboxEnv`, a SkyRL-Gym `BaseTextEnv`
  (init / step / close over one sandbox per trajectory).

Each imports its framework when it is installed and subclasses the framework's base class; without
it, plain-Python stand-ins with the same signatures keep the module importable in a light client
install (`pip install tangram-rl`). Nothing is imported here: import the submodule you use.
See docs/integrations.md.
"""
