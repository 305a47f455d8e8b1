"""room_command_timing carries every field of CommandTiming (emit() names them one by one)."""

from __future__ import annotations

import math
from dataclasses import fields

from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from roomservice.observability.timing import CommandTiming, rounded_ms


def test_emit_logs_every_field_with_ms_rounded() -> None:
    timing = CommandTiming(command="JoinRoom", app_code="a", room_id="r", command_id="c1", total_ms=1.23456)
    with capture_logs() as logs:
        timing.emit()
    (line,) = [entry for entry in logs if entry["event"] == "room_command_timing"]
    assert set(line) - {"event", "log_level"} == {f.name for f in fields(CommandTiming)}
    assert line["total_ms"] == 1.235


@given(st.floats(min_value=0.0, max_value=1e9, allow_nan=False))
def test_rounded_ms_is_round_to_three_decimals_but_for_exact_halves(value: float) -> None:
    got = rounded_ms(value)
    assert got == round(got, 3)  # a whole number of microseconds,
    assert "e" in repr(got) or len(repr(got).partition(".")[2]) <= 3  # written with three decimals at most
    assert abs(got - value) <= 0.0005 + 1e-12 * value  # the nearest microsecond
    scaled = value * 1000.0
    if abs(scaled - int(scaled) - 0.5) > 1e-6:  # not within a hair of a half: exactly round()'s answer
        assert got == round(value, 3)


def test_rounded_ms_keeps_zero_and_what_is_not_a_duration() -> None:
    assert rounded_ms(0.0) == 0.0
    assert rounded_ms(-1.23456) == -1.235  # (never a duration; rounded as round() does)
    assert rounded_ms(float("inf")) == float("inf")
    assert math.isnan(rounded_ms(float("nan")))
    assert rounded_ms(0.0004) == 0.0 and rounded_ms(0.9876) == 0.988
