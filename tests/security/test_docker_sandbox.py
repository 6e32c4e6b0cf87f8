"""What a Docker sandbox contains (issue 11, finding 3), against the real dockerd, through the real executor.

On every exec path (``fastpath``: the spawner; ``nsenter``: the fast path without one; ``docker``: docker
exec): sandbox code runs as an unprivileged user with no capabilities and ``no_new_privs``; the hostroot
image shows an ``/etc`` of the agent's making, not the host's; a sandbox opened without ``mem`` has the
agent's default memory limit; writes stop at the disk limit with ENOSPC; whatever an action starts in the
background (``setsid``, ``nohup``, a double fork) runs on its cores only and is gone when it returns.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

from agent.executors import docker_limits, sandbox_etc
from agent.executors.base import RunRequest, SandboxSpec, TooLarge, parse_cpuset
from agent.executors.docker import DockerExecutor
from tangram.errors import ConfigError

MODES = ["fastpath", "nsenter", "docker"]  # nsenter: the fast path with its spawner switched off
MEM_MIB = 64  # the executors' default sandbox memory here
DISK_MIB = 16
LOOP = "while :; do :; done"


def _need_root_for(mode: str) -> None:
    if mode != "docker" and os.geteuid() != 0:
        pytest.skip("the fast path needs root")


def _cores() -> tuple[str, int]:
    """(idle set, the core granted to actions): the last core of this process's affinity."""
    mine = sorted(os.sched_getaffinity(0))
    return ",".join(map(str, mine)), mine[-1]


def make_executor(docker_client, image: str, mode: str, tmp_path) -> DockerExecutor:
    idle, _ = _cores()
    return DockerExecutor(
        docker_client,
        f"t{uuid.uuid4().hex[:8]}",
        idle,
        image,
        mode="fastpath" if mode == "nsenter" else mode,
        spawner=mode != "nsenter",
        mem_mib=MEM_MIB,
        disk_mib=DISK_MIB,
        workdir=str(tmp_path),
    )


@pytest.fixture
async def executors(docker_client, tmp_path):
    made: list[DockerExecutor] = []

    def make(image: str, mode: str) -> DockerExecutor:
        _need_root_for(mode)
        ex = make_executor(docker_client, image, mode, tmp_path)
        made.append(ex)
        return ex

    yield make
    for ex in made:
        await ex.close()
        for name in await ex.list_sandboxes():
            await ex.destroy_sandbox(name)


def spec(image: str, labels: dict[str, str], mem_mib: int = 0, name: str = "s1") -> SandboxSpec:
    """A sandbox as the agent opens one: no user (the agent's default), ``mem_mib`` 0 (none asked for)."""
    return SandboxSpec(name, image, mem_mib, dict(labels), pids_limit=128)


def req(cmd: str, timeout_s: float = 30.0, **kw) -> RunRequest:
    return RunRequest(f"a-{uuid.uuid4().hex[:8]}", "s1", cmd, (_cores()[1],), timeout_s=timeout_s, **kw)


def status_fields(stdout: bytes) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in stdout.decode().splitlines()) if v}


def container_of(ex: DockerExecutor, docker_client, name: str = "s1"):
    return docker_client.containers.get(f"tangram-{ex.cluster}-{name}")


def left_loops(container) -> list[list[str]]:
    """Processes of the container (``docker top``) running the busy loop."""
    procs = container.top(ps_args="-eo pid,user,args")["Processes"] or []
    return [p for p in procs if LOOP in p[-1]]


# ---------------------------------------------------------------- user, capabilities


@pytest.mark.docker
@pytest.mark.parametrize("mode", MODES)
async def test_sandbox_code_is_unprivileged(
    executors, mode, busybox_image, hostroot_image, test_labels, docker_client
):
    for image in (busybox_image, hostroot_image):
        ex = executors(image, mode)
        await ex.create_sandbox(spec(image, test_labels))
        r = await ex.run(
            req(
                "grep -E '^(Uid|Gid|Groups|Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs|Seccomp):' "
                "/proc/self/status; stat -c 'owner: %u' /work; echo hi > mine && cat mine"
            )
        )
        assert r.exit_code == 0, r
        f = status_fields(r.stdout)
        assert f["Uid"].split() == ["65534"] * 4 and f["Gid"].split() == ["65534"] * 4, f
        assert f["Groups"] in ("", "65534"), f
        for cap in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
            assert f[cap] == "0000000000000000", (image, cap, f)
        assert f["NoNewPrivs"] == "1", f
        if mode != "nsenter":  # Docker's default seccomp profile (the nsenter fallback cannot apply one)
            assert f["Seccomp"] == "2", f
        assert f["owner"] == "65534" and r.stdout.endswith(b"hi\n")
        c = container_of(ex, docker_client)
        host = c.attrs["HostConfig"]
        assert host["CapDrop"] == ["ALL"] and "no-new-privileges" in host["SecurityOpt"]
        assert host["NetworkMode"] == "none" and host["PidsLimit"] == 128
        assert not any("seccomp" in o for o in host["SecurityOpt"])  # Docker's default profile
        # the container's own processes (docker-init, its sleeper) are not root either
        users = {p[1] for p in c.top(ps_args="-eo pid,user,args")["Processes"]}
        assert "root" not in users and "0" not in users, users
        await ex.destroy_sandbox("s1")


@pytest.mark.docker
@pytest.mark.parametrize("mode", MODES)
async def test_root_when_asked_for_has_no_capability_on_any_path(
    executors, mode, busybox_image, hostroot_image, test_labels
):
    # busybox's setpriv only sets no_new_privs: the nsenter chain (which starts from the agent's root) must
    # not run root's code there; the spawner or docker exec do
    for image in (busybox_image, hostroot_image):
        ex = executors(image, mode)
        await ex.create_sandbox(SandboxSpec("s1", image, 0, dict(test_labels), user="0:0"))
        r = await ex.run(req("grep -E '^(Uid|Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs):' /proc/self/status"))
        f = status_fields(r.stdout)
        assert f["Uid"].split()[0] == "0", f
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert f[cap] == "0000000000000000", (image, mode, cap, f)
        assert f["NoNewPrivs"] == "1", f
        await ex.destroy_sandbox("s1")


# ---------------------------------------------------------------- no host secrets


@pytest.mark.docker
@pytest.mark.parametrize("mode", ["fastpath", "docker"])
async def test_hostroot_sees_no_host_secrets_and_still_runs_the_host_toolchain(
    executors, mode, hostroot_image, test_labels
):
    ex = executors(hostroot_image, mode)
    await ex.create_sandbox(spec(hostroot_image, test_labels))
    r = await ex.run(req("cat /etc/shadow; echo shadow=$?; cat /etc/passwd; ls /etc"))
    out = r.stdout.decode()
    assert "shadow=1" in out and b"No such file" in r.stderr, r
    with open("/etc/passwd") as f:  # noqa: ASYNC230 - a small local file
        assert f.read() not in out  # not the host's
    listing = set(out.split())
    for secret in ("shadow", "gshadow", "ssh", "sudoers", "pip.conf", "npmrc", "gitconfig", "machine-id"):
        assert secret not in listing, (secret, out)
    r = await ex.run(req("ls /etc/ssl; test -e /etc/ssl/private; echo private=$?"))
    assert b"private=1" in r.stdout, r
    cmd = (
        "python3 -c 'import ssl, json, os, pwd; print(json.dumps([pwd.getpwuid(os.getuid()).pw_name, "
        "os.getcwd(), os.environ[\"HOME\"]]))' && sh -c 'echo from-sh > f && cat f'"
    )
    r = await ex.run(req(cmd))
    assert r.exit_code == 0, r
    assert r.stdout == b'["sandbox", "/work", "/work"]\nfrom-sh\n'


def test_sandbox_etc_is_generated_and_copies_only_what_is_wanted(tmp_path):
    host = tmp_path / "host"
    (host / "ssl" / "certs").mkdir(parents=True)
    (host / "ssl" / "private").mkdir()
    (host / "ssl" / "private" / "key.pem").write_text("SECRET")
    (host / "ssl" / "certs" / "ca.pem").write_text("CA")
    (host / "ssl" / "certs" / "link.pem").symlink_to("/usr/share/ca-certificates/x.crt")
    (host / "shadow").write_text("root:SECRET:::")
    (host / "passwd").write_text("root:x:0:0::/root:/bin/bash\nalice:x:1000:1000::/home/alice:/bin/bash\n")
    (host / "ld.so.cache").write_bytes(b"cache")
    (host / "python3.11").mkdir()
    (host / "python3.11" / "sitecustomize.py").write_text("# site")
    hidden = host / "timezone"
    hidden.write_text("Etc/UTC")
    hidden.chmod(0o600)  # not world-readable: left out
    out = sandbox_etc.ensure(str(tmp_path / "etc"), (65534, 65534), (65533, 65533), etc=str(host))
    got = sorted(os.path.relpath(os.path.join(d, n), out) for d, ds, fs in os.walk(out) for n in ds + fs)
    assert got == [
        "group",
        "hostname",
        "hosts",
        "ld.so.cache",
        "nsswitch.conf",
        "passwd",
        "python3.11",
        "python3.11/sitecustomize.py",
        "resolv.conf",
        "ssl",
        "ssl/certs",
        "ssl/certs/ca.pem",
        "ssl/certs/link.pem",
    ]
    with open(os.path.join(out, "passwd")) as f:
        passwd = f.read()
    assert "alice" not in passwd and "sandbox:x:65534:65534:" in passwd and "keeper:x:65533:" in passwd
    assert os.readlink(os.path.join(out, "ssl/certs/link.pem")) == "/usr/share/ca-certificates/x.crt"
    assert oct(os.stat(os.path.join(out, "passwd")).st_mode & 0o777) == "0o644"
    # content-addressed: the same inputs give the same directory, other inputs another one
    assert sandbox_etc.ensure(str(tmp_path / "etc"), (65534, 65534), (65533, 65533), etc=str(host)) == out
    assert sandbox_etc.ensure(str(tmp_path / "etc"), (1000, 1000), (65533, 65533), etc=str(host)) != out


# ---------------------------------------------------------------- memory


@pytest.mark.docker
@pytest.mark.parametrize("mode", MODES)
async def test_sandbox_without_mem_gets_the_default_limit(
    executors, mode, busybox_image, test_labels, docker_client
):
    ex = executors(busybox_image, mode)
    await ex.create_sandbox(spec(busybox_image, test_labels, mem_mib=0))
    host = container_of(ex, docker_client).attrs["HostConfig"]
    assert host["Memory"] == host["MemorySwap"] == MEM_MIB << 20
    r = await ex.run(req("dd if=/dev/zero of=/dev/null bs=16M count=1 && echo small-ok"))
    assert r.exit_code == 0 and b"small-ok" in r.stdout, r
    r = await ex.run(req("dd if=/dev/zero of=/dev/null bs=200M count=1"))
    assert r.exit_code == 137 and not r.timed_out, r
    r = await ex.run(req("echo alive"))
    assert r.stdout == b"alive\n"


# ---------------------------------------------------------------- disk


@pytest.mark.docker
@pytest.mark.parametrize("mode", MODES)
async def test_disk_fill_stops_at_the_limit(executors, mode, busybox_image, test_labels):
    ex = executors(busybox_image, mode)
    assert ex.limits.disk in ("storage_opt", "tmpfs")
    await ex.create_sandbox(spec(busybox_image, test_labels, mem_mib=256))
    for where in ("/work/fill", "/tmp/fill"):
        cmd = f"dd if=/dev/zero of={where} bs=1M count=64; echo rc=$?; wc -c < {where}; rm {where}"
        r = await ex.run(req(cmd))
        out = r.stdout.decode().split()
        assert b"No space left on device" in r.stderr, (where, r)
        assert out[0] != "rc=0" and int(out[1]) <= DISK_MIB << 20, (where, r)
    if ex.limits.disk == "tmpfs":  # nothing else is writable
        r = await ex.run(req("touch /x /etc/x /usr/x 2>&1; echo rc=$?"))
        assert r.stdout.count(b"Read-only file system") >= 2 or b"Permission denied" in r.stdout, r
    with pytest.raises(TooLarge, match="no space left"):
        await ex.put("s1", "big.bin", b"\0" * ((DISK_MIB + 4) << 20))
    await ex.run(req("rm -f big.bin"))  # what did fit of it
    await ex.put("s1", "small.bin", b"ok")  # the workdir still takes files
    assert await ex.get("s1", "small.bin") == b"ok"
    r = await ex.run(req("cat small.bin"))
    assert r.stdout == b"ok"


class _Info:
    def __init__(self, info: dict, create_error: Exception | None = None) -> None:
        self._info, self.created, self.removed, self._error = info, [], [], create_error
        self.api = self

    def info(self) -> dict:
        return self._info

    def create_host_config(self, **kw):
        return kw

    def create_container(self, image, cmd, host_config, labels):
        if self._error is not None:
            raise self._error
        self.created.append(host_config)
        return {"Id": "probe"}

    def remove_container(self, cid, force):
        self.removed.append(cid)


def test_disk_limit_mode_follows_the_storage_driver():
    ext4 = {"Driver": "overlay2", "DriverStatus": [["Backing Filesystem", "extfs"]], "OSType": "linux"}
    assert docker_limits.choose_disk(_Info(ext4), 16, "img") == "tmpfs"
    assert docker_limits.choose_disk(_Info(ext4), 0, "img") == "none"
    xfs = {"Driver": "overlay2", "DriverStatus": [["Backing Filesystem", "xfs"]], "OSType": "linux"}
    client = _Info(xfs)
    assert docker_limits.choose_disk(client, 16, "img") == "storage_opt"
    assert client.created == [{"storage_opt": {"size": "16m"}, "network_mode": "none"}]
    assert client.removed == ["probe"]
    refused = RuntimeError("--storage-opt is supported only for overlay over xfs with 'pquota' mount option")
    assert docker_limits.choose_disk(_Info(xfs, refused), 16, "img") == "tmpfs"
    windows = {"Driver": "windowsfilter", "OSType": "windows"}
    with pytest.raises(ConfigError, match="cannot be enforced") as caught:
        docker_limits.choose_disk(_Info(windows), 16, "img")
    assert "sandbox_disk_mib" in caught.value.hint


def test_agent_config_keys_and_the_default_memory():
    from agent.config import AgentConfig
    from agent.probe import mem_offer_mib, meminfo

    cfg = AgentConfig.from_dict({"controller": "tcp://127.0.0.1:7700"})
    assert (cfg.docker_user, cfg.sandbox_mem_mib, cfg.sandbox_disk_mib) == ("65534:65534", None, 1024)
    cfg = AgentConfig.from_dict(
        {
            "controller": "tcp://127.0.0.1:7700",
            "sandbox_mem_mib": "2GiB",
            "sandbox_disk_mib": "16MiB",
            "docker_user": "1000:1000",
        }
    )
    assert (cfg.docker_user, cfg.sandbox_mem_mib, cfg.sandbox_disk_mib) == ("1000:1000", 2048, 16)
    for bad in ({"docker_user": "nobody"}, {"sandbox_disk_mib": -1}):
        with pytest.raises(ConfigError):
            AgentConfig.from_dict({"controller": "tcp://127.0.0.1:7700", **bad})
    # a sandbox opened without `mem` never goes unlimited: sandbox_mem_mib, else mem_mib, else the offer
    assert docker_limits.default_mem_mib(512) == 512
    assert docker_limits.default_mem_mib(None) == mem_offer_mib(meminfo()) > 0
    with pytest.raises(ConfigError, match="sandbox_mem_mib"):
        docker_limits.default_mem_mib(1)


# ---------------------------------------------------------------- background processes


@pytest.mark.docker
async def test_background_processes_end_with_the_action_in_every_mode(
    executors, busybox_image, test_labels, docker_client
):
    _, core = _cores()
    modes = ["docker"] + (["fastpath", "nsenter"] if os.geteuid() == 0 else [])
    for mode in modes:
        ex = executors(busybox_image, mode)
        await ex.create_sandbox(spec(busybox_image, test_labels))
        c = container_of(ex, docker_client)
        # setsid, nohup and a double fork, each a busy loop; the action itself returns at once
        cmd = (
            f"setsid sh -c '{LOOP}' & p=$!; nohup sh -c '{LOOP}' >/dev/null 2>&1 & "
            f"(sh -c '{LOOP}' >/dev/null 2>&1 &); sleep 0.3; grep Cpus_allowed_list /proc/$p/status; "
            f"echo started"
        )
        r = await ex.run(req(cmd))
        assert r.exit_code == 0 and r.stdout.endswith(b"started\n"), (mode, r)
        line = r.stdout.decode().splitlines()[0]
        assert parse_cpuset(line.split(":", 1)[1]) == (core,), (mode, line)  # on the granted core only
        assert left_loops(c) == [], (mode, left_loops(c))
        # the same when the action is cut short by its deadline
        r = await ex.run(req(f"setsid sh -c '{LOOP}' & sleep 30", timeout_s=1.0))
        assert r.timed_out, (mode, r)
        assert left_loops(c) == [], (mode, left_loops(c))
        r = await ex.run(req("echo still-here"))  # the sandbox itself lives on
        assert r.stdout == b"still-here\n", (mode, r)
        await asyncio.sleep(0)
        await ex.destroy_sandbox("s1")


@pytest.mark.docker
@pytest.mark.parametrize("mode", ["fastpath", "docker"])
async def test_a_restarted_agent_sweeps_what_a_dead_one_left(
    executors, mode, busybox_image, test_labels, docker_client, tmp_path
):
    ex = executors(busybox_image, mode)
    await ex.create_sandbox(spec(busybox_image, test_labels))
    c = container_of(ex, docker_client)
    cmd = f"setsid sh -c '{LOOP}' >/dev/null 2>&1 & sleep 60"
    task = asyncio.ensure_future(ex.run(req(cmd, timeout_s=120)))
    for _ in range(100):
        if left_loops(c):
            break
        await asyncio.sleep(0.05)
    assert left_loops(c), "the daemon did not start"
    # the agent "dies" (its executor is dropped mid-action); the next one recovers before its Hello
    fresh = make_executor(docker_client, busybox_image, mode, tmp_path)
    fresh.cluster = ex.cluster
    found = await fresh.recover()
    # docker mode: killing the dead agent's exec may let that agent's own end-of-action sweep (it still
    # runs in this test process) take the daemon before recovery's sweep looks, so count either
    assert found.containers == 1 and found.execs + found.swept + found.processes >= 1, found
    assert left_loops(c) == []
    r = await asyncio.wait_for(task, 30)  # what the dead agent was waiting for ends too
    assert r.exit_code != 0
    r = await fresh.run(req("echo adopted"))
    assert r.stdout == b"adopted\n"
    await fresh.close()
