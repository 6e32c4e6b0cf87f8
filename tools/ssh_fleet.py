"""Time `tangram up INVENTORY` against a fleet of real sshd "nodes" on 127.0.0.2, .3, ... (one
sshd per address, tests/support/sshd.py), the way docs/operations.md section 4 reports it.

    nice -n 19 python tools/ssh_fleet.py --hosts 8                # first up, no-op up x3, down
    nice -n 19 python tools/ssh_fleet.py --hosts 32 --parallel 32
    python tools/ssh_fleet.py --hosts 8 --keep                   # leave it running; prints how to stop it

Each run prints its wall time (the `tangram` process, start to exit), its exit code, and per step
the median and the slowest host (from `up -o json`, whose ``hosts[].timings`` holds each step's
seconds). Everything lives in a temporary directory (TANGRAM_HOME, node workdirs, sshd configs),
removed at the end with the sshd processes, after `tangram down --purge`. Run it as root (the
nodes log in as root by key); it sends traffic only to 127.0.0.0/8.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from e2e.test_up_ssh_failures import host, write_inventory  # noqa: E402
from support.sshd import Sshd, make_client_key, sshd_available  # noqa: E402

CLI = [sys.executable, "-c", "from tangram_cli.main import cli; cli()"]


def inventory(tmp: Path, key: Path, servers: list[Sshd], cluster: str) -> Path:
    """Node ``n<i>`` on the i-th sshd, one core each (round robin over this machine's), its own workdir."""
    ncpu = len(os.sched_getaffinity(0))
    hosts = [host(f"n{i + 1}", s.host, s.port, str(i % ncpu), tmp / "nodes") for i, s in enumerate(servers)]
    return write_inventory(tmp, cluster, hosts, key=str(key))


def tangram(home: Path, *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    env = {**os.environ, "TANGRAM_HOME": str(home), "NO_COLOR": "1"}
    for name in ("TANGRAM_ADDR", "TANGRAM_INVENTORY", "TANGRAM_CLUSTER"):
        env.pop(name, None)
    t0 = time.monotonic()
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, check=False)
    return time.monotonic() - t0, proc


def steps_line(doc: dict) -> str:
    """``connect 0.21/0.40  check 0.05/0.09 ...``: per step, the median and the slowest host."""
    per: dict[str, list[float]] = {}
    for h in doc.get("hosts", []):
        for step, secs in (h.get("timings") or {}).items():
            per.setdefault(step, []).append(float(secs))
    order = ("connect", "check", "files", "probe", "upload", "install", "start", "wait")
    ordered = sorted(per.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
    return "  ".join(f"{s} {statistics.median(v):.2f}/{max(v):.2f}" for s, v in ordered)


def report(label: str, wall: float, proc: subprocess.CompletedProcess[str]) -> None:
    try:
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        doc = {}
    ok = sum(1 for h in doc.get("hosts", []) if h.get("registered"))
    print(f"{label:<10} {wall:6.2f}s  exit {proc.returncode}  registered {ok}/{len(doc.get('hosts', []))}")
    if doc:
        print(f"           steps (median/max s): {steps_line(doc)}")
    if proc.returncode not in (0, 3):
        print(proc.stderr[-3000:])


def start_fleet(tmp: Path, n: int, key) -> list[Sshd]:
    servers = []
    for i in range(n):
        s = Sshd(f"127.0.0.{i + 2}", 22022, tmp / f"sshd-{i + 2}", [key])
        servers.append(s)
        s.start()
    return servers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=None, help="`up --parallel` (default: tangram's)")
    ap.add_argument("--noop-runs", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="leave the cluster and the sshd fleet running")
    args = ap.parse_args()
    if reason := sshd_available():
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="tangram-fleet-"))
    home, servers = tmp / "home", []
    try:
        key = make_client_key(tmp)
        servers = start_fleet(tmp, args.hosts, key)
        inv = inventory(tmp, key.path, servers, f"fleet{args.hosts}")
        extra = ["--parallel", str(args.parallel)] if args.parallel else []
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"{args.hosts} sshd on 127.0.0.2-{args.hosts + 1}, {os.cpu_count()} cpus, load {load}; {inv}")
        report("first up", *tangram(home, "up", str(inv), "-o", "json", *extra))
        for i in range(args.noop_runs):
            report(f"no-op up {i + 1}", *tangram(home, "up", str(inv), "-o", "json", *extra))
        if args.keep:
            print(f"kept: TANGRAM_HOME={home} tangram down {inv} --purge; then kill the sshd pids in {tmp}")
            servers = []
            return 0
        wall, down = tangram(home, "down", str(inv), "--purge")
        print(f"{'down':<10} {wall:6.2f}s  exit {down.returncode}")
        return 0
    finally:
        for s in servers:
            s.stop()
        if servers:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
