"""room_command_timing: one structured line per write command request, success or failure (SPEC §2).

The pipeline (``RoomService.execute``) emits it for every command it runs; a
command request refused before it reaches the pipeline (bad JSON, a missing
field, 413, a body that never came) is emitted by the route instead
(``roomservice.api.routing``), with the error code as ``result`` and empty
ids where the request gave no valid ones. Either way it counts once in
``room_commands_total`` and ``room_command_seconds``, and its stages (the
``*_ms`` fields of :data:`~roomservice.observability.metrics.STAGES`, those that
ran) go to ``room_command_stage_seconds``; these are applied once per turn of
the event loop for all its commands (:class:`~roomservice.observability.metrics.CommandMetrics`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final

from roomservice.observability.logging import get_logger, write_info_line
from roomservice.observability.metrics import COMMAND_METRICS

_log = get_logger("roomservice.command")


@dataclass(slots=True)
class CommandTiming:
    command: str
    app_code: str
    room_id: str
    command_id: str
    result: str = "ok"
    version: int = 0
    total_ms: float = 0.0
    idempotency_ms: float = 0.0
    lease_ms: float = 0.0
    wallet_debit_ms: float = 0.0
    save_mutation_ms: float = 0.0
    snapshot_ms: float = 0.0
    projection_ms: float = 0.0
    activity_ms: float = 0.0  # never a synchronous activity call: always 0
    tencent_im_ms: float = 0.0
    activity_async_outbox: bool = False
    tencent_im_async_outbox: bool = False
    replayed: bool = False

    def emit(self) -> None:
        # written out, not a loop over fields(): this runs once per command (issue 12); the line is
        # written directly when logging is the configured JSON stream (structlog's chain was ~40 %
        # of a command's log line and metrics), through structlog otherwise (console, capture_logs)
        fields = {
            "command": self.command,
            "app_code": self.app_code,
            "room_id": self.room_id,
            "command_id": self.command_id,
            "result": self.result,
            "version": self.version,
            "total_ms": rounded_ms(self.total_ms),
            "idempotency_ms": rounded_ms(self.idempotency_ms),
            "lease_ms": rounded_ms(self.lease_ms),
            "wallet_debit_ms": rounded_ms(self.wallet_debit_ms),
            "save_mutation_ms": rounded_ms(self.save_mutation_ms),
            "snapshot_ms": rounded_ms(self.snapshot_ms),
            "projection_ms": rounded_ms(self.projection_ms),
            "activity_ms": rounded_ms(self.activity_ms),
            "tencent_im_ms": rounded_ms(self.tencent_im_ms),
            "activity_async_outbox": self.activity_async_outbox,
            "tencent_im_async_outbox": self.tencent_im_async_outbox,
            "replayed": self.replayed,
        }
        if not write_info_line("room_command_timing", fields):
            _log.info("room_command_timing", **fields)
        COMMAND_METRICS.record(
            self.command,
            self.result,
            (
                self.idempotency_ms,
                self.lease_ms,
                self.wallet_debit_ms,
                self.save_mutation_ms,
                self.snapshot_ms,
                self.projection_ms,
                self.total_ms,
            ),
        )


_EXACT_BELOW_MS: Final = 2.0**52 / 1000.0  # below it, value * 1000 + 0.5 is exact when it is a half (and no inf)


def rounded_ms(value: float) -> float:
    """``value`` to the microsecond (three decimals), a half rounded up: what ``round(value, 3)``
    gives but for a value exactly halfway, at half its cost (round() with digits goes through a
    correctly rounded decimal conversion; ~3,000 instructions against ~1,600 here, and a command
    rounds seven). A stage that did not run (0.0, most of them) is returned as it is."""
    if 0.0 < value < _EXACT_BELOW_MS:
        return int(value * 1000.0 + 0.5) / 1000.0
    return round(value, 3) if value else value


class Stopwatch:
    """Milliseconds since construction (or the last ``lap``), from a monotonic clock."""

    __slots__ = ("_start",)

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self._start) * 1000.0

    def lap(self) -> float:
        now = time.perf_counter()
        ms = (now - self._start) * 1000.0
        self._start = now
        return ms
