"""The fast core subset: ``pytest tests/core -m core_fast`` (docs/testing.md).

Every test module in this folder is in it except the long randomised runs listed in ``SLOW``
(they run in the full suite). The subset is what the mutation run (``tools/mutation.sh``)
measures the core against, so a new scenario test here joins it without further ado.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SLOW = frozenset(
    {
        "test_scheduler_properties.py",  # hypothesis over whole traces, ~20 s
        "test_approx_reference.py",  # ApproxACTs against its reference, ~20 s
        "test_bench_cli.py",  # the `tangram bench` command, not the core
    }
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "core_fast: the fast core subset (tests/core/conftest.py)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.path).resolve()
        if path.parent == HERE and path.name not in SLOW:
            item.add_marker(pytest.mark.core_fast)
