"""tangram_cli.hostlist: expand and compress, with Hypothesis round trips."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tangram_cli.hostlist import MAX_HOSTS, HostlistError, compress, expand


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (
            "cpu-[01-04,07].internal",
            ["cpu-01.internal", "cpu-02.internal", "cpu-03.internal", "cpu-04.internal", "cpu-07.internal"],
        ),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
        ("plain.host", ["plain.host"]),
        ("x[3],x[3]", ["x3"]),
    ],
)
def test_expand(pattern, expected):
    assert expand(pattern) == expected


@pytest.mark.parametrize(
    ("pattern", "fragment"),
    [
        ("a[1-2", "unbalanced"),
        ("a]1", "unbalanced"),
        ("a[[1]]", "nested"),
        ("a[2-1]", "reversed"),
        ("a[]", "bad range"),
        ("a[x]", "bad range"),
        ("a[1-]", "bad range"),
        ("a[-1]", "bad range"),
        ("a,,b", "empty"),
        ("", "empty"),
        ("a, b", "white space"),
        ("n[0-99]x[0-999]", "more than"),
        ("n[0-10000]", "more than"),
    ],
)
def test_expand_rejects(pattern, fragment):
    with pytest.raises(HostlistError, match=fragment):
        expand(pattern)


def test_limit_is_exact():
    assert len(expand(f"n[1-{MAX_HOSTS}]")) == MAX_HOSTS
    with pytest.raises(HostlistError):
        expand(f"n[0-{MAX_HOSTS}]")


def test_compress_examples():
    assert compress(["cpu-01", "cpu-02", "cpu-03"]) == "cpu-[01-03]"
    assert compress(["gpu-02"]) == "gpu-02"
    assert compress(["n1", "n3", "n2", "n7", "head"]) == "n[1-3,7],head"
    assert compress(["n9", "n10", "n08"]) == "n[9-10],n08"
    assert compress([]) == ""


labels = st.from_regex(r"[a-z]{1,4}(-[a-z]{1,3})?", fullmatch=True)
names = st.builds(
    lambda p, n, w, s: f"{p}{str(n).zfill(w)}{s}",
    labels,
    st.integers(0, 300),
    st.integers(0, 4),
    st.sampled_from(["", ".internal", "-x"]),
)


@given(st.lists(names, max_size=40))
def test_compress_round_trips(hosts):
    if not hosts:
        assert compress(hosts) == ""
        return
    assert sorted(expand(compress(hosts))) == sorted(set(hosts))


@given(st.lists(st.integers(0, 500), min_size=1, max_size=30, unique=True), st.integers(1, 4))
def test_expand_compress_expand(nums, width):
    pattern = "h[" + ",".join(str(n).zfill(width) for n in sorted(nums)) + "].x"
    hosts = expand(pattern)
    assert len(hosts) == len(nums)
    assert expand(compress(hosts)) == hosts
