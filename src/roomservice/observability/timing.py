"""room_command_timing: one structured line per write command, success or failure (SPEC §2)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from roomservice.observability.logging import get_logger
from roomservice.observability.metrics import COMMAND_SECONDS, COMMANDS

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
        fields = asdict(self)
        for key, value in fields.items():
            if key.endswith("_ms") and isinstance(value, float):
                fields[key] = round(value, 3)
        _log.info("room_command_timing", **fields)
        COMMANDS.labels(self.command, self.result).inc()
        COMMAND_SECONDS.labels(self.command).observe(self.total_ms / 1000.0)


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
