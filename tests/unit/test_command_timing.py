"""room_command_timing carries every field of CommandTiming (emit() names them one by one)."""

from __future__ import annotations

from dataclasses import fields

from structlog.testing import capture_logs

from roomservice.observability.timing import CommandTiming


def test_emit_logs_every_field_with_ms_rounded() -> None:
    timing = CommandTiming(command="JoinRoom", app_code="a", room_id="r", command_id="c1", total_ms=1.23456)
    with capture_logs() as logs:
        timing.emit()
    (line,) = [entry for entry in logs if entry["event"] == "room_command_timing"]
    assert set(line) - {"event", "log_level"} == {f.name for f in fields(CommandTiming)}
    assert line["total_ms"] == 1.235
