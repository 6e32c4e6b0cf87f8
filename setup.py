"""Tangram: action-level resource management for agentic RL (ARL-Tangram)."""
from setuptools import find_packages, setup

setup(
    name="tangram-rl",
    version="0.1.0",
    description="Action-level scheduling of CPU sandboxes, GPU services and API quotas for agentic RL",
    python_requires=">=3.10",
    packages=find_packages(include=["tangram", "tangram.*", "tangram_cli", "tangram_cli.*", "agent", "agent.*"]),
    package_data={"tangram": ["py.typed", "sim/workloads/*.yaml"], "tangram_cli": ["data/*.yaml"]},
    install_requires=[
        "click>=8.1",
        "asyncssh>=2.14",
        "docker>=7.0",
        "nvidia-ml-py>=12.0",
        "rich>=13.0",
        "pyyaml>=6.0",
        "pyzmq>=25.0",
        "msgpack>=1.0",
        "pydantic>=2.5",
        "numpy>=1.24",
    ],
    extras_require={
        "test": ["pytest>=7.4", "pytest-timeout>=2.2", "pytest-asyncio>=0.23", "hypothesis>=6.90"],
        "plot": ["matplotlib>=3.7"],
        "gpu": ["torch"],
    },
    entry_points={"console_scripts": ["tangram=tangram_cli.main:cli"]},
)
