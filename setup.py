"""Tangram: action-level resource management for agentic RL (ARL-Tangram).

Two installs (docs/integrations.md, "Installing"):

    pip install tangram-rl              # the client library only: rollout workers, RL framework adapters
    pip install 'tangram-rl[cluster]'   # + the `tangram` command: up/down, controller, agent, demo, sim

The plain install brings only what `import tangram` and the client need (pyzmq, msgpack);
`[test]` includes `[cluster]`.
"""

from setuptools import find_packages, setup

# What `import tangram` and `tangram.AsyncClient` / `tangram.Client` load (tests/client and
# tests/integrations/test_light_install.py check that nothing else is imported).
CLIENT = ["pyzmq>=25.0", "msgpack>=1.0"]
# The cluster side: the CLI, the controller, the agent (Docker, NVML), the bootstrap over SSH,
# the simulator and the scheduling core's numeric parts.
CLUSTER = [
    "click>=8.1",
    "asyncssh>=2.14",
    "docker>=7.0",
    "nvidia-ml-py>=12.0",
    "rich>=13.0",
    "pyyaml>=6.0",
    "pydantic>=2.5",
    "numpy>=1.24",
    "prometheus-client>=0.17",  # the controller's metrics endpoint (tangram_cli/controller/metrics_http.py)
]
# skyrl-gym: tests/integrations/test_skyrl.py runs the env against the real BaseTextEnv (verl needs
# torch and ray, and its wheel ships a top-level `tests` package: tested in a side venv only,
# docs/integrations.md).
TEST = ["pytest>=7.4", "pytest-timeout>=2.2", "pytest-asyncio>=0.23", "hypothesis>=6.90", "skyrl-gym>=0.4",
        "matplotlib>=3.7"]  # matplotlib: tests/sim/test_plots.py draws the experiments' figures

setup(
    name="tangram-rl",
    version="0.1.0",
    description="Action-level scheduling of CPU sandboxes, GPU services and API quotas for agentic RL",
    python_requires=">=3.10",
    packages=find_packages(
        include=["tangram", "tangram.*", "tangram_cli", "tangram_cli.*", "agent", "agent.*"]
    ),
    package_data={"tangram": ["py.typed", "sim/workloads/*.yaml"], "tangram_cli": ["data/*.yaml"]},
    install_requires=CLIENT,
    extras_require={
        "cluster": CLUSTER,
        "test": CLUSTER + TEST,
        "plot": ["matplotlib>=3.7"],
        "gpu": ["torch"],
    },
    entry_points={"console_scripts": ["tangram=tangram_cli.main:cli"]},
)
