"""The benchmarks of `tangram bench` (tangram_cli/commands/bench.py adds their commands).

One module per benchmark (`scheduler`, `dispatch`, `burst`, `scale`, `chaos`, `pool`), the
client processes some of them start (`python -m tangram_cli.bench.burst`, `... .scale`,
`... .chaos_load`), and what they share: `procs` (the controller, agents and clients of a run),
`agents` (many model agent identities in one process), `chaos_cluster` (the cluster the chaos
bench breaks) and `goals` (PASS/FAIL of figures against their goals). Figures are printed,
never asserted (docs/performance.md).
"""
