"""The one wall clock: milliseconds since the epoch (injectable everywhere as ``clock``)."""

from __future__ import annotations

import time


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000
