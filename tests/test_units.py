"""tangram.units, table-driven: sizes, durations and cpulists parse one way (docs/cli.md, "Units"),
and every consumer (client, agent configuration, agent probe and executors, inventory) agrees."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent import probe
from agent.config import parse_cpulist as agent_cpulist
from agent.config import parse_mib as agent_mib
from agent.executors.base import parse_cpuset as executor_cpulist
from tangram import units
from tangram.client.aio import parse_mem as client_mem
from tangram.errors import BadRequest, ConfigError, UnitError
from tangram_cli.inventory import parse_cpuset as inventory_cpulist
from tangram_cli.inventory import parse_duration_ms as inventory_ms
from tangram_cli.inventory import parse_size_mib as inventory_mib

SIZES = [  # (value, MiB)
    (0, 0),
    (2048, 2048),
    ("2048", 2048),
    (" 512 ", 512),
    ("4GiB", 4096),
    ("4 GiB", 4096),
    ("4gib", 4096),
    ("4GIB", 4096),
    ("1.5GiB", 1536),
    ("512MiB", 512),
    ("2048KiB", 2),
    ("1TiB", 1 << 20),
    ("1048576B", 1),
    ("2GB", 1907),  # 2 * 10^9 bytes, rounded down to whole MiB
    ("2gb", 1907),
    ("1000MB", 953),
    ("1TB", 953674),
    ("0GiB", 0),
]

BAD_SIZES = [  # (value, what the message says)
    ("2G", "ambiguous unit 'G'"),
    ("2g", "ambiguous unit 'g'"),
    ("1T", "ambiguous unit 'T'"),
    ("4XB", "unknown unit 'XB'"),
    ("4 gigs", "unknown unit 'gigs'"),
    ("1.5", "without a unit must be whole MiB"),
    ("-1GiB", "negative size"),
    (-5, "negative size"),
    ("0.5MiB", "below 1 MiB"),
    ("1KiB", "below 1 MiB"),
    ("1e3MiB", "cannot read size"),
    ("+1GiB", "cannot read size"),
    ("", "cannot read size"),
    ("lots", "cannot read size"),
    (True, "not a size"),
    (1.5, "not a size"),
    (None, "not a size"),
]

DURATIONS = [  # (value, seconds)
    (3, 3.0),
    (0.25, 0.25),
    ("10", 10.0),
    ("10s", 10.0),
    ("10 S", 10.0),
    ("500ms", 0.5),
    ("1.5m", 90.0),
    ("2h", 7200.0),
    ("0s", 0.0),
]

BAD_DURATIONS = [
    ("10sec", "unknown unit 'sec'"),
    ("-1s", "negative duration"),
    ("1e3s", "cannot read duration"),
    (float("nan"), "not a finite duration"),
    (-1, "not a finite duration"),
    (True, "not a duration"),
    ([1], "not a duration"),
]

CPULISTS = [  # (value, cores)
    ("0", (0,)),
    ("0-3,8", (0, 1, 2, 3, 8)),
    ("0-3, 8", (0, 1, 2, 3, 8)),  # spaces around items
    (" 8 ,0-1 ", (0, 1, 8)),
    ("0-3,8\n", (0, 1, 2, 3, 8)),  # a kernel file's trailing newline
    ("10-12", (10, 11, 12)),
    ("8191", (8191,)),
    ([3, 1], (1, 3)),
    ((0, 2), (0, 2)),
]

BAD_CPULISTS = [
    ("", "empty cpulist"),
    (" ", "empty cpulist"),
    ([], "empty cpulist"),
    ("007", "no leading zeros"),
    ("01-3", "no leading zeros"),
    ("0 - 1", "is not N or N-M"),
    ("0,,1", "is not N or N-M"),
    ("0-", "is not N or N-M"),
    ("-1", "is not N or N-M"),
    ("0x1", "is not N or N-M"),
    ("0-3:2", "is not N or N-M"),  # no stride syntax
    ("3-1", "reversed range"),
    ("1,1", "listed twice"),
    ("1-2,2", "listed twice"),
    ([1, 1], "listed twice"),
    ("8192", "above 8191"),
    ([True], "core numbers must be"),
    ([-1], "core numbers must be"),
    (8, "not a cpulist"),
    (1.5, "not a cpulist"),
]


@pytest.mark.parametrize(("value", "mib"), SIZES)
def test_sizes(value, mib) -> None:
    assert units.parse_size_mib(value) == mib


@pytest.mark.parametrize(("value", "why"), BAD_SIZES)
def test_bad_sizes_name_the_value_and_the_forms(value, why) -> None:
    with pytest.raises(UnitError) as info:
        units.parse_size_mib(value, "mem")
    msg = str(info.value)
    assert msg.startswith("mem: ") and why in msg and repr(value) in msg and units.SIZE_FORMS in msg
    assert info.value.value == value and info.value.what == "mem" and info.value.hint


def test_size_unit_required_and_limit() -> None:
    assert units.parse_size_mib("4GiB", unit_required=True) == 4096
    for bare in (4096, "4096"):
        with pytest.raises(UnitError, match="missing unit"):
            units.parse_size_mib(bare, unit_required=True)
    assert units.parse_size_mib("64TiB", max_mib=1 << 26) == 1 << 26
    with pytest.raises(UnitError, match="above the limit of 64TiB"):
        units.parse_size_mib(10**8, max_mib=1 << 26)


@pytest.mark.parametrize(("value", "seconds"), DURATIONS)
def test_durations(value, seconds) -> None:
    assert units.parse_duration_s(value) == seconds
    assert units.parse_duration_ms(value) == int(seconds * 1000)


@pytest.mark.parametrize(("value", "why"), BAD_DURATIONS)
def test_bad_durations(value, why) -> None:
    with pytest.raises(UnitError, match=why) as info:
        units.parse_duration_s(value, "timeout")
    assert str(info.value).startswith("timeout: ") and units.DURATION_FORMS in str(info.value)


def test_duration_unit_required_and_milliseconds() -> None:
    assert units.parse_duration_ms("0.3s") == 300 and units.parse_duration_ms(0.3) == 300  # not 299
    for bare in (10, "10"):
        with pytest.raises(UnitError, match="missing unit"):
            units.parse_duration_ms(bare, unit_required=True)
    with pytest.raises(UnitError, match="below 1 ms"):
        units.parse_duration_ms("0.1ms")


@pytest.mark.parametrize(("value", "cores"), CPULISTS)
def test_cpulists(value, cores) -> None:
    assert units.parse_cpulist(value) == cores


@pytest.mark.parametrize(("value", "why"), BAD_CPULISTS)
def test_bad_cpulists(value, why) -> None:
    with pytest.raises(UnitError, match=why) as info:
        units.parse_cpulist(value, "idle_cpus")
    assert str(info.value).startswith("idle_cpus: ") and units.CPULIST_FORMS in str(info.value)


def test_empty_cpulist_where_allowed() -> None:
    assert (
        units.parse_cpulist("\n", allow_empty=True) == () and units.parse_cpulist([], allow_empty=True) == ()
    )


def test_unit_error_is_every_bad_input_error() -> None:
    err = UnitError("x")
    assert isinstance(err, BadRequest) and isinstance(err, ConfigError) and isinstance(err, ValueError)
    assert err.code.value == "BAD_REQUEST" and err.exit_code == 2 and not err.retryable


@given(st.sets(st.integers(0, units.MAX_CPU), min_size=1, max_size=64))
def test_cpulist_round_trip(cores) -> None:
    assert units.parse_cpulist(units.format_cpulist(cores)) == tuple(sorted(cores))


@given(st.integers(0, 1 << 40))
def test_size_round_trip(mib) -> None:
    text = units.format_size_mib(mib)
    assert units.parse_size_mib(text) == mib and units.parse_size_mib(text, unit_required=True) == mib


# ---------------------------------------------------------------- the consumers agree


@pytest.mark.parametrize("value", [v for v, _ in SIZES if isinstance(v, str) and not v.strip().isdigit()])
def test_client_agent_and_inventory_read_a_size_alike(value) -> None:
    expected = units.parse_size_mib(value)
    assert client_mem(value) == agent_mib(value) == inventory_mib(value) == expected


@pytest.mark.parametrize("value", [v for v, _ in BAD_SIZES if isinstance(v, str)])
def test_client_agent_and_inventory_refuse_a_size_alike(value) -> None:
    for parse in (client_mem, agent_mib, inventory_mib):
        with pytest.raises(UnitError):
            parse(value)


@pytest.mark.parametrize("value", [v for v, _ in CPULISTS if isinstance(v, str)])
def test_every_cpulist_parser_agrees(value) -> None:
    cores = units.parse_cpulist(value)
    assert tuple(agent_cpulist(value)) == executor_cpulist(value) == inventory_cpulist(value) == cores
    assert tuple(probe.parse_cpulist(value)) == cores


@pytest.mark.parametrize("value", [v for v, _ in BAD_CPULISTS if isinstance(v, str) and v.strip()])
def test_every_cpulist_parser_refuses_alike(value) -> None:
    for parse in (agent_cpulist, executor_cpulist, inventory_cpulist, probe.parse_cpulist):
        with pytest.raises(UnitError):
            parse(value)


def test_inventory_durations_need_a_unit() -> None:
    assert inventory_ms("10s") == 10_000 and inventory_ms("1.5m") == 90_000
    with pytest.raises(UnitError, match="missing unit"):
        inventory_ms("10")
