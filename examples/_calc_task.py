"""The task both adapter examples (verl_tool.py, skyrl_env.py) hand to a sandbox: a one-line bug in
`calc.py` and a test script that runs its cases on `{dop}` worker processes (an elastic test run)."""

RUN_TESTS = """\
import sys
from multiprocessing import Pool

sys.dont_write_bytecode = True  # a fix of the same size within a second must not meet a stale .pyc

CASES = [((1, 2), 3), ((0, 0), 0), ((-1, 1), 0), ((2, 2), 4)]


def check(case):
    import calc

    args, want = case
    return calc.add(*args) == want


if __name__ == "__main__":
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    with Pool(workers) as pool:
        results = pool.map(check, CASES)
    passed = sum(results)
    print(f"{passed} passed, {len(results) - passed} failed (workers={workers})")
    sys.exit(0 if passed == len(results) else 1)
"""

# calc.py with its bug (a - b), and the tests: what a task dataset row would carry
FILES = {"calc.py": "def add(a, b):\n    return a - b\n", "run_tests.py": RUN_TESTS}
