"""Synthetic test run for `tangram demo` (stdlib only; put into each sandbox as ``testrun.py``).

    python3 testrun.py WORKERS UNITS [HASHES_PER_UNIT]

Runs a fixed amount of CPU work (UNITS units of chained sha256) split over WORKERS forked
processes, like ``pytest -n WORKERS`` over a fixed test suite: more workers, same total work.
Prints one line, ``UNITS passed in S s (WORKERS workers)``; exit 0.
"""

import hashlib
import os
import sys
import time


def work(units: int, per_unit: int) -> bytes:
    h = b"tangram-demo" * 4
    for _ in range(units * per_unit):
        h = hashlib.sha256(h).digest()
    return h


def main(argv: list[str]) -> int:
    workers = max(1, int(argv[1]) if len(argv) > 1 else 1)
    units = max(1, int(argv[2]) if len(argv) > 2 else 30)
    per_unit = max(1, int(argv[3]) if len(argv) > 3 else 100_000)
    workers = min(workers, units)
    shares = [units // workers + (1 if i < units % workers else 0) for i in range(workers)]
    t0 = time.perf_counter()
    children = []
    for share in shares[1:]:
        pid = os.fork()
        if pid == 0:
            try:
                work(share, per_unit)
            finally:
                os._exit(0)
        children.append(pid)
    work(shares[0], per_unit)
    failed = 0
    for pid in children:
        _, status = os.waitpid(pid, 0)
        failed += status != 0
    print(f"{units} passed in {time.perf_counter() - t0:.3f}s ({workers} workers)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
