"""Child processes without threads or extra execs: the executors' spawn primitive.

* ``spawn_pinned``: ``posix_spawn`` (glibc's ``clone(CLONE_VM|CLONE_VFORK)``: no page-table copy, no
  ``preexec_fn``) through ``ctypes``, because ``os.posix_spawn`` has no working-directory action; where libc
  lacks ``posix_spawn_file_actions_addchdir_np`` or ``..._addclosefrom_np`` (glibc has both since 2.34) it
  falls back to ``subprocess.Popen``'s vfork path (same result, ~50 us more CPU). The child leads a new
  session, gets default SIGPIPE/SIGXFSZ (Python ignores them), an empty signal mask and only its stdio, as
  with ``Popen(restore_signals=True, start_new_session=True)``.
  It runs with the *calling thread's* CPU affinity set to the granted cores for the duration of the call:
  Linux copies the forking thread's affinity into the child, and every descendant inherits it, so the
  action is on its cores from its first instruction without ``taskset`` or a shim exec. The thread's own
  affinity is restored right after (two ``sched_setaffinity`` calls; ~30 us of CPU when the thread must
  migrate, and on a busy machine the thread may wait for the other core: the executors use a spawner
  process first, see ``spawner``).
* ``ExitWatch``: a pidfd registered with the event loop (``add_reader``), instead of asyncio's child
  watcher (one thread per child). It only *observes* the exit: the caller kills what the child left
  behind (its process group, or its cgroup) while the zombie still pins the pid, and then ``reap``s.
  Without pidfds (old kernels) a worker thread waits with ``waitid(WNOWAIT)``, which does not reap either.
* ``ChildIO``: the three pipes. The parent's ends are non-blocking; stdout and stderr go into capped
  ``OutputCollector``s (nothing past the cap is kept), stdin is fed from bytes (``add_writer`` while the pipe
  is full) and then closed. Most actions end within a millisecond, with their output still in the pipes:
  those are read once, after the exit, without ever registering a reader. Only a child still running after
  ``READERS_AFTER_S`` gets ``add_reader``s: one that fills a pipe (64 KiB) sooner waits at most that long.

All of it runs on the event loop thread, with no per-child task: an action that exits at once costs one
loop iteration for its exit and its two EOFs together.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import os
import signal
import subprocess
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .base import OutputCollector

READ_CHUNK = 1 << 16
READS_PER_WAKEUP = 16  # a flooding child cannot hold the loop for more than this many reads at once
READERS_AFTER_S = 0.005  # output of a child that runs longer is read as it comes (see ChildIO)

_devnull_fd = -1


def devnull() -> int:
    """A shared read-only ``/dev/null`` descriptor (close-on-exec; children get it through dup2)."""
    global _devnull_fd
    if _devnull_fd < 0:
        _devnull_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    return _devnull_fd


# ---------------------------------------------------------------- spawning


@contextlib.contextmanager
def thread_pinned(cores: Iterable[int]):  # type: ignore[no-untyped-def]
    """Run the body with the calling thread (only it: ``sched_setaffinity(0)`` is per thread) on ``cores``."""
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def spawn_pinned(argv: Sequence[str], *, env: dict[str, str], cwd: str | None, cores: Iterable[int] | None,
                 fds: tuple[int, int, int]) -> int:
    """Start ``argv`` (``argv[0]`` an absolute path) as a session leader in ``cwd`` on ``cores`` (None:
    unpinned) with ``fds`` as its stdio; returns its pid. Raises OSError when it cannot start."""
    if cores is None:
        return _spawn(argv, env, cwd, fds)
    with thread_pinned(cores):
        return _spawn(argv, env, cwd, fds)


def _spawn(argv: Sequence[str], env: dict[str, str], cwd: str | None, fds: tuple[int, int, int]) -> int:
    if _libc is None or (_libc is False and not _load_libc()):
        proc = subprocess.Popen(argv, stdin=fds[0], stdout=fds[1], stderr=fds[2], cwd=cwd, env=env,
                                start_new_session=True)
        proc.returncode = 0  # the caller reaps it (ExitWatch.reap); keeps Popen.__del__ from doing so
        return proc.pid
    return _libc_spawn(argv, env, cwd, fds)


_POSIX_SPAWN_SETSIGDEF, _POSIX_SPAWN_SETSIGMASK, _POSIX_SPAWN_SETSID = 0x04, 0x08, 0x80  # glibc and musl
_libc: Any = False  # False: not loaded yet; None: unusable (Popen fallback)
_attr: Any = None


def _load_libc() -> bool:
    """Bind libc's posix_spawn family once; build the (read-only, shared) spawn attributes."""
    global _libc, _attr
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ptr, c_int = ctypes.c_void_p, ctypes.c_int
        for name, args in (("posix_spawn_file_actions_init", [ptr]),
                           ("posix_spawn_file_actions_destroy", [ptr]),
                           ("posix_spawn_file_actions_adddup2", [ptr, c_int, c_int]),
                           ("posix_spawn_file_actions_addchdir_np", [ptr, ctypes.c_char_p]),
                           ("posix_spawn_file_actions_addclosefrom_np", [ptr, c_int]),
                           ("posix_spawnattr_init", [ptr]),
                           ("posix_spawnattr_setflags", [ptr, ctypes.c_short]),
                           ("posix_spawnattr_setsigdefault", [ptr, ptr]),
                           ("posix_spawnattr_setsigmask", [ptr, ptr]),
                           ("sigemptyset", [ptr]), ("sigaddset", [ptr, c_int]),
                           ("posix_spawn", [ptr, ctypes.c_char_p, ptr, ptr, ptr, ptr])):
            fn = getattr(libc, name)
            fn.argtypes, fn.restype = args, c_int
    except (OSError, AttributeError):
        _libc = None
        return False
    attr, default, mask = _Opaque(), _Opaque(), _Opaque()  # posix_spawnattr_t is 336 bytes, sigset_t 128
    libc.sigemptyset(mask)
    libc.sigemptyset(default)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        libc.sigaddset(default, sig)
    libc.posix_spawnattr_init(attr)
    libc.posix_spawnattr_setsigdefault(attr, default)
    libc.posix_spawnattr_setsigmask(attr, mask)
    flags = _POSIX_SPAWN_SETSID | _POSIX_SPAWN_SETSIGDEF | _POSIX_SPAWN_SETSIGMASK
    libc.posix_spawnattr_setflags(attr, flags)
    _libc, _attr = libc, attr
    return True


_Opaque = ctypes.c_uint64 * 128  # 1 KiB, 8-byte aligned: room for any libc's opaque spawn structures


def _libc_spawn(argv: Sequence[str], env: dict[str, str], cwd: str | None, fds: tuple[int, int, int]) -> int:
    libc = _libc
    args = [os.fsencode(a) for a in argv]
    envp = [os.fsencode(f"{k}={v}") for k, v in env.items()]
    c_argv = (ctypes.c_char_p * (len(args) + 1))(*args, None)
    c_envp = (ctypes.c_char_p * (len(envp) + 1))(*envp, None)
    actions, pid = _Opaque(), ctypes.c_int(0)
    libc.posix_spawn_file_actions_init(actions)
    try:
        for target, fd in enumerate(fds):
            libc.posix_spawn_file_actions_adddup2(actions, fd, target)
        libc.posix_spawn_file_actions_addclosefrom_np(actions, 3)  # as Popen's close_fds: inherited ones too
        if cwd is not None:
            libc.posix_spawn_file_actions_addchdir_np(actions, os.fsencode(cwd))
        err = libc.posix_spawn(ctypes.byref(pid), args[0], actions, _attr, c_argv, c_envp)
    finally:
        libc.posix_spawn_file_actions_destroy(actions)
    if err:
        raise OSError(err, f"cannot start {argv[0]}: {os.strerror(err)}" + (f" (in {cwd})" if cwd else ""))
    return pid.value


def kill_group(pid: int) -> None:
    """SIGKILL the process group (= session) ``pid`` leads; quiet when it is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


# ---------------------------------------------------------------- exit


def _wait_nowait(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


class ExitWatch:
    """Observes the exit of our child ``pid`` without reaping it."""

    def __init__(self, pid: int, on_exit: Callable[[], None] | None = None) -> None:
        self.pid = pid
        self.exited = False
        self._on_exit = on_exit
        self._loop = asyncio.get_running_loop()
        self._waiters: list[asyncio.Future[bool]] = []
        self._fd = -1
        try:
            self._fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfds here: a thread waits, without reaping
            waiter = self._loop.run_in_executor(None, _wait_nowait, pid)
            waiter.add_done_callback(lambda _: self._fire())
            return
        self._loop.add_reader(self._fd, self._fire)

    def _fire(self) -> None:
        if self.exited:
            return
        self.close()
        self.exited = True
        for waiter in self._waiters:  # completed directly: the waiting task runs in the next iteration
            if not waiter.done():
                waiter.set_result(True)
        if self._on_exit is not None:
            self._on_exit()

    async def wait(self, timeout_s: float | None) -> bool:
        """True once the child has exited; False when ``timeout_s`` passed first."""
        if self.exited:
            return True
        waiter: asyncio.Future[bool] = self._loop.create_future()
        self._waiters.append(waiter)
        timer = None
        if timeout_s is not None:
            timer = self._loop.call_later(max(0.0, timeout_s), _settle, waiter, False)
        try:
            return await waiter
        finally:
            if timer is not None:
                timer.cancel()
            self._waiters.remove(waiter)

    def reap(self) -> int:
        """Collect the exit status (after ``exited``): the exit code, or -N when killed by signal N."""
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status)

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1


def _settle(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():
        fut.set_result(value)


async def wait_done(fut: asyncio.Future[None], timeout_s: float | None) -> bool:
    """Wait for ``fut`` at most ``timeout_s``; True when it completed. ``fut`` itself is never cancelled
    (cheaper than ``asyncio.wait_for``: one timer handle, no task)."""
    if fut.done():
        return True
    if timeout_s is None:
        await asyncio.shield(fut)
        return True
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[bool] = loop.create_future()
    timer = loop.call_later(max(0.0, timeout_s), _settle, waiter, False)
    done_cb = lambda _: _settle(waiter, True)  # noqa: E731
    fut.add_done_callback(done_cb)
    try:
        return await waiter
    finally:
        timer.cancel()
        fut.remove_done_callback(done_cb)


# ---------------------------------------------------------------- pipes


class ChildIO:
    """Pipes for one child. ``child_fds`` go to the spawn; ``start`` (right after it) closes them here and
    starts pumping; ``eof`` completes when stdout and stderr have both ended; ``close`` stops everything."""

    def __init__(self, cap: int, stdin: bytes | None) -> None:
        self.out, self.err = OutputCollector(cap), OutputCollector(cap)
        self._loop = asyncio.get_running_loop()
        self.eof: asyncio.Future[None] = self._loop.create_future()
        self._readers: dict[int, OutputCollector] = {}
        self._watching = False
        self._timer: asyncio.TimerHandle | None = None
        self._deadline: float | None = None
        self._on_timeout: Callable[[], None] | None = None
        self._child: list[int] = []
        self._in_w, self._in_data, self._in_pos = -1, memoryview(stdin or b""), 0
        try:
            if stdin is None:
                in_r = devnull()
            else:
                in_r, self._in_w = os.pipe2(os.O_CLOEXEC)
                self._child.append(in_r)
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            self._readers[out_r] = self.out
            self._child.append(out_w)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            self._readers[err_r] = self.err
            self._child.append(err_w)
        except BaseException:
            self.close()
            raise
        self.child_fds = (in_r, out_w, err_w)

    @property
    def truncated(self) -> bool:
        return self.out.truncated or self.err.truncated

    def start(self, timeout_s: float | None = None, on_timeout: Callable[[], None] | None = None) -> None:
        """After the spawn: close the child's ends here, feed stdin, and arm one timer that starts reading
        after ``READERS_AFTER_S`` and then (when given) calls ``on_timeout`` at ``timeout_s`` from now
        (one timer instead of two for the many actions that end before the first fires)."""
        for fd in self._child:
            os.close(fd)
        self._child.clear()
        for fd in self._readers:
            fcntl.fcntl(fd, fcntl.F_SETFL, os.O_NONBLOCK)  # a fresh pipe end has no other status flags
        self._on_timeout, self._deadline = on_timeout, None
        if on_timeout is not None and timeout_s is not None:
            self._deadline = self._loop.time() + timeout_s
        first = READERS_AFTER_S if self._deadline is None else min(READERS_AFTER_S, timeout_s or 0.0)
        self._timer = self._loop.call_later(first, self._watch)
        if self._in_w >= 0:
            fcntl.fcntl(self._in_w, fcntl.F_SETFL, os.O_NONBLOCK)
            if self._write():
                self._loop.add_writer(self._in_w, self._on_writable)

    def _watch(self) -> None:
        """Read the output as it comes, from now on; then wait for the deadline, if there is one."""
        self._timer = None
        if not self._watching:
            self._watching = True
            for fd in self._readers:
                self._loop.add_reader(fd, self._read, fd)
        if self._deadline is not None:
            if self._loop.time() >= self._deadline:
                self._deadline, on_timeout = None, self._on_timeout
                assert on_timeout is not None
                on_timeout()
            else:
                self._timer = self._loop.call_at(self._deadline, self._watch)

    def _read(self, fd: int) -> None:
        sink = self._readers.get(fd)
        if sink is None:
            return
        for _ in range(READS_PER_WAKEUP):
            try:
                data = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._close_reader(fd)
                return
            sink.feed(data)

    def _close_reader(self, fd: int) -> None:
        if self._watching:
            self._loop.remove_reader(fd)
        os.close(fd)
        del self._readers[fd]
        if not self._readers and not self.eof.done():
            self.eof.set_result(None)

    def _write(self) -> bool:
        """Write what the pipe takes; True while there is more to write."""
        try:
            while self._in_pos < len(self._in_data):
                self._in_pos += os.write(self._in_w, self._in_data[self._in_pos:self._in_pos + READ_CHUNK])
        except BlockingIOError:
            return True
        except OSError:  # EPIPE: the child does not read its stdin
            pass
        self._close_stdin()
        return False

    def _on_writable(self) -> None:
        self._write()  # closes stdin (and drops the writer) once everything is written

    def _close_stdin(self) -> None:
        if self._in_w >= 0:
            self._loop.remove_writer(self._in_w)
            os.close(self._in_w)
            self._in_w = -1
        self._in_data = memoryview(b"")

    def exited(self) -> None:
        """The child has exited: no deadline any more (its output may still come)."""
        self._deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def wait_eof(self, timeout_s: float) -> bool:
        """After the child's exit: take what the pipes hold; wait (at most ``timeout_s``) only while something
        it left behind still holds one open."""
        self.exited()
        for fd in list(self._readers):
            self._read(fd)
        if self.eof.done():
            return True
        self._watch()
        return await wait_done(self.eof, timeout_s)

    def close(self) -> None:
        """Stop reading and writing and close every descriptor still open (idempotent)."""
        self.exited()
        for fd in self._child:
            os.close(fd)
        self._child.clear()
        for fd in list(self._readers):
            self._loop.remove_reader(fd)
            os.close(fd)
        self._readers.clear()
        self._close_stdin()
        if not self.eof.done():
            self.eof.set_result(None)
