"""What the adapter tests share: a small task (a buggy module and its test runner) and readers of
`tangram status -o json`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# From `support`, not `tests.e2e`: verl's wheel installs a top-level `tests` package that shadows
# this repository's in a verl environment.
from support.cli import tangram

# The test runner writes what {dop} became, and a pytest-style summary line the "pytest" reward reads.
RUN_TESTS = """\
import sys
from multiprocessing import Pool

sys.dont_write_bytecode = True

CASES = [((1, 2), 3), ((0, 0), 0), ((-1, 1), 0), ((2, 2), 4)]


def check(case):
    import calc

    args, want = case
    return calc.add(*args) == want


if __name__ == "__main__":
    workers = int(sys.argv[1])
    with Pool(workers) as pool:
        results = pool.map(check, CASES)
    passed = sum(results)
    print(f"workers={workers}")
    print(f"{passed} passed, {len(results) - passed} failed")
    sys.exit(0 if passed == len(results) else 1)
"""
FILES = {"calc.py": "def add(a, b):\n    return a - b\n", "run_tests.py": RUN_TESTS}
FIX = "sed -i 's/a - b/a + b/' calc.py"
TEST_OPTIONS: dict[str, Any] = {
    "timeout": 20,
    "test_command": "python3 run_tests.py {dop}",
    "test_cpus": [1, 2],
    "test_elastic": {1: 1.0, 2: 0.95},
    "test_duration_hint": 1.0,
    "test_timeout": 60,
    "reward": "pytest",
}


def status(home: Path) -> dict[str, Any]:
    r = tangram("status", "-o", "json", home=home, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def sandboxes_of(home: Path, client_name: str) -> int:
    """Open sandboxes of the connected clients named `client_name`, as `tangram status` reports them."""
    clients = status(home)["records"]["clients"]
    return sum(c["sandboxes"] for c in clients if c["name"] == client_name and c["connected"])


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return check()
