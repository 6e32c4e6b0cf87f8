"""The workload of `tangram demo` (tangram_cli/commands/demo.py prints it).

`workload`: the trajectories, run once per-action scheduled and once against a static baseline,
and their metrics; `testrun`: the stdlib-only script each sandbox runs as its test suite.
"""
