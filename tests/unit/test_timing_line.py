"""The room_command_timing line written without structlog's chain is the line structlog writes.

``write_info_line`` (observability/logging.py) must give the same keys, in the
same order, with the same values, as ``logger.info(event, **fields)`` through
the chain :func:`configure_logging` installs; and must stand aside (write
nothing, return False) as soon as structlog is configured otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.contextvars import bound_contextvars
from structlog.testing import capture_logs

from roomservice.observability import logging as logs
from roomservice.observability import timing
from roomservice.observability.timing import CommandTiming


@pytest.fixture
def configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """configure_logging to a file; structlog's configuration as it was afterwards."""
    saved = structlog.get_config()
    saved_processors = list(saved["processors"])
    monkeypatch.setattr(logs, "_json_lines", None)
    path = tmp_path / "log"
    with path.open("w") as stream:
        logs.configure_logging(level="info", json=True, file=stream)
        # no logger of another test may keep this file: nothing is cached on first use here
        structlog.configure(cache_logger_on_first_use=False)
        # the timing module's logger, cached on its first use by an earlier test, would still write
        # through that test's chain: a fresh one here, as a fresh process has
        monkeypatch.setattr(timing, "_log", logs.get_logger("roomservice.command"))
        try:
            yield path
        finally:
            structlog.configure(**{**saved, "processors": saved_processors})


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _timing() -> CommandTiming:
    return CommandTiming(
        command="JoinRoom",
        app_code="a",
        room_id="r",
        command_id="c1",
        version=7,
        total_ms=1.23456,
        lease_ms=0.0004,
        save_mutation_ms=0.9876,
        tencent_im_async_outbox=True,
    )


def test_the_direct_line_is_structlogs_line(configured: Path) -> None:
    timing = _timing()
    with bound_contextvars(app_code="a", room_id="r", command_id="c1", trace_id="t-1", extra={"k": 1}):
        timing.emit()
        fields = {
            "command": "JoinRoom",
            "app_code": "a",
            "room_id": "r",
            "command_id": "c1",
            "result": "ok",
            "version": 7,
            "total_ms": 1.235,
            "idempotency_ms": 0.0,
            "lease_ms": 0.0,
            "wallet_debit_ms": 0.0,
            "save_mutation_ms": 0.988,
            "snapshot_ms": 0.0,
            "projection_ms": 0.0,
            "activity_ms": 0.0,
            "tencent_im_ms": 0.0,
            "activity_async_outbox": False,
            "tencent_im_async_outbox": True,
            "replayed": False,
        }
        structlog.get_logger("roomservice.command").info("room_command_timing", **fields)
    direct, chain = _lines(configured)
    assert direct.pop("timestamp").endswith("Z") and chain.pop("timestamp").endswith("Z")
    assert list(direct.items()) == list(chain.items())  # same keys, same order, same values
    assert direct["trace_id"] == "t-1" and direct["extra"] == {"k": 1} and direct["level"] == "info"


def test_a_value_json_cannot_encode_is_written_as_its_repr(configured: Path) -> None:
    marker = object()
    assert logs.write_info_line("e", {"odd": marker, 1: "int key"})
    (line,) = _lines(configured)
    assert line["odd"] == repr(marker) and line["1"] == "int key"


def test_it_stands_aside_while_logs_are_captured(configured: Path) -> None:
    with capture_logs() as captured:
        assert not logs.write_info_line("e", {"a": 1})
        _timing().emit()
    assert [entry["event"] for entry in captured] == ["room_command_timing"]
    assert configured.read_text() == ""
    assert logs.write_info_line("e", {"a": 1})  # the configuration is back in place


def test_it_stands_aside_under_another_configuration(configured: Path) -> None:
    structlog.configure(processors=[structlog.processors.JSONRenderer()])
    assert not logs.write_info_line("e", {"a": 1})


def test_an_info_line_under_level_warning_is_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = structlog.get_config()
    monkeypatch.setattr(logs, "_json_lines", None)
    path = tmp_path / "log"
    try:
        with path.open("w") as stream:
            logs.configure_logging(level="warning", json=True, file=stream)
            structlog.configure(cache_logger_on_first_use=False)
            monkeypatch.setattr(timing, "_log", logs.get_logger("roomservice.command"))  # as above
            assert logs.write_info_line("e", {"a": 1})
            _timing().emit()
    finally:
        structlog.configure(**saved)
    assert path.read_text() == ""
