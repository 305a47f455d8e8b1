"""iso_utc: the log lines' timestamp is exactly what structlog's ISO UTC TimeStamper writes."""

from __future__ import annotations

import datetime

from hypothesis import given
from hypothesis import strategies as st

from roomservice.observability.logging import iso_utc

EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def structlogs(ns: int) -> str:
    """``datetime.now(UTC).isoformat().replace("+00:00", "Z")`` at ``ns`` (now() floors to microseconds)."""
    return (EPOCH + datetime.timedelta(microseconds=ns // 1000)).isoformat().replace("+00:00", "Z")


seconds = st.integers(min_value=0, max_value=4_102_444_800)  # 1970 .. 2100
nanos = st.one_of(st.integers(0, 999_999_999), st.sampled_from([0, 999, 1000, 999_999_999]))


@given(seconds, nanos)
def test_it_writes_what_the_timestamper_writes(second: int, nano: int) -> None:
    ns = second * 1_000_000_000 + nano
    assert iso_utc(ns) == structlogs(ns)


@given(st.lists(st.tuples(st.integers(0, 3), nanos), min_size=2, max_size=20))
def test_the_cached_second_never_leaks_into_another(steps: list[tuple[int, int]]) -> None:
    base = 1_764_720_000
    for offset, nano in steps:  # the same second again, the next one, back: each from its own time
        ns = (base + offset) * 1_000_000_000 + nano
        assert iso_utc(ns) == structlogs(ns)


def test_a_whole_second_has_no_fraction() -> None:
    assert iso_utc(1_764_720_000 * 1_000_000_000) == "2025-12-03T00:00:00Z"
