"""What one hop between processes costs on this machine: the floor under Tangram's per-action figures.

An action crosses four processes (client, controller, agent, the sandbox's spawner) and three ZeroMQ
links. This prints, for this machine, one line per measurement:

* ``pipe``: a one-byte ping-pong between two processes over pipes, both pinned to one core and to two
  cores: wall time per round trip (two wake-ups). Across cores an idle core must be woken first.
* ``eventfd``: the CPU the waker spends in one ``write`` to an eventfd, with a thread of the same
  process blocked on it (in ``epoll``) and with nobody waiting: what waking a thread costs the waker.
  ZeroMQ wakes its I/O thread this way for a message sent while that thread sleeps.
* ``zmq``: a ROUTER in this process and a DEALER in a child, one five-part message there and back at a
  time, over TCP on 127.0.0.1 and over IPC: wall time per round trip and this process's CPU (its
  application thread and its I/O thread) per round trip.

Used in docs/performance.md (eleventh round) to tell what the code costs from what the machine
charges for every hop. Standard library and pyzmq only; sends nothing beyond 127.0.0.1.

    python3 scripts/hop_costs.py [-n 5000]
"""
from __future__ import annotations

import argparse
import os
import resource
import select
import tempfile
import threading
import time

import zmq


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def pipe_round_trip(n: int, cpu_a: int, cpu_b: int) -> float:
    """Microseconds per round trip between this process (on `cpu_a`) and a child (on `cpu_b`)."""
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child answers every byte
        os.sched_setaffinity(0, {cpu_b})
        for _ in range(n):
            os.read(r1, 1)
            os.write(w2, b"x")
        os._exit(0)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu_a})
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(w1, b"x")
            os.read(r2, 1)
        return (time.perf_counter() - t0) / n * 1e6
    finally:
        os.sched_setaffinity(0, before)
        os.waitpid(pid, 0)
        for fd in (r1, w1, r2, w2):
            os.close(fd)


def eventfd_wake(n: int) -> tuple[float, float]:
    """Microseconds of the writer's CPU per eventfd write: waking a thread, and with nobody waiting."""
    efd, back = os.eventfd(0), os.eventfd(0)

    def waiter() -> None:
        ep = select.epoll()
        ep.register(efd, select.EPOLLIN)
        for _ in range(n):
            ep.poll()
            os.eventfd_read(efd)
            os.eventfd_write(back, 1)
        ep.close()

    th = threading.Thread(target=waiter)
    th.start()
    waking = 0.0
    for _ in range(n):
        time.sleep(0.0003)  # the waiter is asleep in epoll again
        t = time.thread_time()
        os.eventfd_write(efd, 1)
        waking += time.thread_time() - t
        os.eventfd_read(back)
    th.join()
    alone = 0.0
    for _ in range(n):
        t = time.thread_time()
        os.eventfd_write(efd, 1)
        alone += time.thread_time() - t
        os.eventfd_read(efd)
    os.close(efd)
    os.close(back)
    return waking / n * 1e6, alone / n * 1e6


def _dealer(addr: str, n: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(addr)
    sock.send(b"hello")
    for _ in range(n):
        sock.send_multipart(sock.recv_multipart())
    sock.close(linger=1000)
    ctx.term()
    os._exit(0)


def zmq_round_trip(n: int, ipc: str | None) -> tuple[float, float]:
    """(wall, this process's CPU) in microseconds per ROUTER -> DEALER -> ROUTER round trip, over
    TCP on 127.0.0.1 (`ipc` None) or over the IPC endpoint `ipc`. The child makes its own context."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    if ipc is None:
        addr = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    else:
        addr = ipc
        router.bind(addr)
    pid = os.fork()
    if pid == 0:
        _dealer(addr, n)
    try:
        ident, _ = router.recv_multipart()
        message = [ident, b"TGM2", b"\x10", bytes(8), b"x" * 150]  # the shape of a small Tangram message
        cpu0, t0 = _cpu_s(), time.perf_counter()
        for _ in range(n):
            router.send_multipart(message)
            router.recv_multipart()
        wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    finally:
        os.waitpid(pid, 0)
        router.close(linger=0)
        ctx.term()
    return wall / n * 1e6, cpu / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=5000, help="round trips per measurement")
    n = ap.parse_args().n
    cpus = sorted(os.sched_getaffinity(0))
    print(f"pipe round trip, one core:   {pipe_round_trip(n, cpus[0], cpus[0]):7.1f} us")
    if len(cpus) > 1:
        print(f"pipe round trip, two cores:  {pipe_round_trip(n, cpus[0], cpus[1]):7.1f} us")
    waking, alone = eventfd_wake(n)
    print(f"eventfd write waking a thread: {waking:5.1f} us of the writer's CPU "
          f"({alone:.1f} us with nobody waiting)")
    with tempfile.TemporaryDirectory() as tmp:
        for name, ipc in (("tcp 127.0.0.1", None), ("ipc", f"ipc://{tmp}/hop.sock")):
            wall, cpu = zmq_round_trip(n, ipc)
            print(f"zmq round trip, {name:13s}: {wall:7.1f} us wall, {cpu:6.1f} us of this process's CPU")


if __name__ == "__main__":
    main()
