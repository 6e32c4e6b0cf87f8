"""Issue 12 below the CLI: a controller that cannot bind fails cleanly (a typed error, nothing
left behind, no AttributeError from the ZAP handler afterwards), `up` words the reason from the
controller's log, and the dry-run checks name the inventory key."""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tangram.errors import ConfigError
from tangram_cli.bootstrap import failures, netaddr, procs
from tangram_cli.controller.config import parse_config
from tangram_cli.controller.daemon import BindAddressNotLocal, Controller, Options

NOT_LOCAL = "203.0.113.7"


def _certs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TANGRAM_HOME", str(tmp_path / "home"))
    from tangram_cli import keys

    return str(keys.ensure_cluster_keys("t", ["n1"]))


def _not_local_or_skip() -> None:
    exc = netaddr.bind_error(NOT_LOCAL)
    if exc is None or exc.errno != errno.EADDRNOTAVAIL:
        pytest.skip(f"{NOT_LOCAL} can be bound here")


def test_port_taken_with_curve_fails_cleanly_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    certs = _certs(tmp_path, monkeypatch)
    seen: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: seen.append(ctx))
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            options = Options(certs=certs, status_port=held.getsockname()[1])
            with pytest.raises(ConfigError, match="Address already in use"):
                Controller(parse_config({"cluster": "t"}), options)
        await asyncio.sleep(0.2)  # the ZAP handler's task ends here: it must not call request_stop

    asyncio.run(main())
    assert seen == []


def test_controller_process_reports_a_taken_port_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    certs = _certs(tmp_path, monkeypatch)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        argv = [*procs.CONTROLLER_ARGV, "--bind", "127.0.0.1", "--certs", certs]
        r = subprocess.run(
            [*argv, "--agents-port", str(held.getsockname()[1])], capture_output=True, text=True, timeout=60
        )
    assert r.returncode == 2, r.stderr
    assert "Address already in use" in r.stderr
    assert "AttributeError" not in r.stderr and "Traceback" not in r.stderr


def test_not_local_bind_is_a_typed_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _not_local_or_skip()
    certs = _certs(tmp_path, monkeypatch)
    with pytest.raises(BindAddressNotLocal, match=f"{NOT_LOCAL} is not an address of this machine") as got:
        Controller(parse_config({"cluster": "t"}), Options(bind=NOT_LOCAL, certs=certs, agents_port=47700))
    assert "127.0.0.1" in (got.value.hint or "")
    assert got.value.exit_code == 2


def test_local_addresses_and_not_local() -> None:
    addrs = netaddr.local_addresses()
    assert "127.0.0.1" in addrs
    assert netaddr.not_local("127.0.0.1") == []
    assert netaddr.not_local("localhost") == []
    assert netaddr.not_local("127.0.0.9") == []  # all of 127.0.0.0/8 is local


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (
            "2026-11-30T01:23:22.123Z INFO controller x: fine\nerror: cannot bind x\nTo fix: y\n",
            "cannot bind x",
        ),
        ("2026-11-30T01:23:22.123Z ERROR controller tangram.controller: it broke\n", "it broke"),
        (json.dumps({"ts": "t", "level": "ERROR", "msg": "json broke"}) + "\n", "json broke"),
        ("Traceback (most recent call last):\n  File x\nValueError: bad\n", "ValueError: bad"),
        ("nothing here\n", ""),
    ],
)
def test_last_error(text: str, want: str) -> None:
    assert procs.last_error(text) == want


def test_controller_failed_reads_only_this_start(tmp_path: Path) -> None:
    log = tmp_path / "controller.log"
    log.write_text("error: an old failure\n")
    offset = log.stat().st_size
    with open(log, "a") as fh:
        fh.write(f"error: cannot bind {NOT_LOCAL}: Cannot assign requested address\n")
    exc = procs.controller_failed(2, log, offset, NOT_LOCAL)
    assert exc.message.endswith(f"during start: cannot bind {NOT_LOCAL}: Cannot assign requested address")
    assert "set controller.bind in the inventory" in (exc.hint or "")
    assert "an old failure" not in (exc.detail or "")


def test_status_rows_skip_nodes_the_controller_knows() -> None:
    failed = [
        {"node": "a", "step": "connect", "reason": "refused", "destination": "root@h:22"},
        {"node": "b", "step": "wait", "reason": "late"},
    ]
    rows = failures.status_rows(failed, known=["b"])
    assert [(r["node"], r["state"]) for r in rows] == [("a", "failed")]
    assert rows[0]["reason"] == "`up` failed at connect: refused"


def test_controller_process_refuses_a_not_local_bind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _not_local_or_skip()
    certs = _certs(tmp_path, monkeypatch)
    argv = [*procs.CONTROLLER_ARGV, "--bind", NOT_LOCAL, "--certs", certs, "--agents-port", "47700"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert procs.last_error(r.stderr).startswith(f"cannot bind {NOT_LOCAL}: Cannot assign requested address")
    assert "Traceback" not in r.stderr
