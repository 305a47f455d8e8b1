"""The overview's chart: delivery rate and backlog over the last hour, sampled in this process's memory.

Every ``interval_s`` the sampler records the rows this process's outbox worker
has delivered so far (the ``room_outbox_rows_finished_total{status="delivered"}``
counter) and the backlog in the database (pending + retryable + delivering
rows). The series lives in memory: it starts empty when the process starts,
covers at most ``window_s``, and another process has its own. The chart is
drawn on the server as inline SVG (no script).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from markupsafe import Markup, escape

from roomservice.observability.logging import get_logger
from roomservice.observability.metrics import REGISTRY

_log = get_logger("roomservice.console")

WINDOW_S: Final = 3600.0
INTERVAL_S: Final = 15.0


@dataclass(frozen=True, slots=True)
class Sample:
    at_ms: int
    delivered_total: float  # this process's counter: rows it delivered since it started
    backlog: int  # rows not finished yet, in the whole database


@dataclass(frozen=True, slots=True)
class Point:
    at_ms: int
    rate_per_min: float  # rows delivered per minute since the previous sample
    backlog: int


def delivered_so_far() -> float:
    """This process's ``room_outbox_rows_finished_total{status="delivered"}`` (0 before its first)."""
    return REGISTRY.get_sample_value("room_outbox_rows_finished_total", {"status": "delivered"}) or 0.0


class DeliverySeries:
    def __init__(self, *, window_s: float = WINDOW_S, interval_s: float = INTERVAL_S) -> None:
        self.window_ms = int(window_s * 1000)
        self.interval_s = interval_s
        self._samples: deque[Sample] = deque(maxlen=int(window_s / interval_s) + 2)

    def record(self, sample: Sample) -> None:
        self._samples.append(sample)

    def points(self, now_ms: int) -> list[Point]:
        """Rates between consecutive samples inside the window (a counter reset reads as 0)."""
        samples = [s for s in self._samples if s.at_ms >= now_ms - self.window_ms]
        points = []
        for before, after in itertools.pairwise(samples):
            minutes = max(after.at_ms - before.at_ms, 1) / 60_000
            delivered = max(0.0, after.delivered_total - before.delivered_total)
            points.append(Point(after.at_ms, delivered / minutes, after.backlog))
        return points

    async def run(self, backlog: Callable[[], Awaitable[int]], clock: Callable[[], int]) -> None:
        """Sample until cancelled; a failed sample (database away) is skipped and logged once per outage."""
        failing = False
        while True:
            try:
                self.record(Sample(clock(), delivered_so_far(), await backlog()))
                failing = False
            except Exception as exc:
                if not failing:
                    _log.warning("console_sample_failed", error=repr(exc)[:200])
                failing = True
            await asyncio.sleep(self.interval_s)


def chart_svg(points: list[Point], *, now_ms: int, window_ms: int, width: int = 600, height: int = 160) -> Markup:
    """Two lines over the window: delivered rows per minute (left scale) and the backlog (right scale)."""
    pad_l, pad_r, pad_t, pad_b = 44, 44, 10, 22
    inner_w, inner_h = width - pad_l - pad_r, height - pad_t - pad_b
    start = now_ms - window_ms
    top_rate = _nice_max(max((p.rate_per_min for p in points), default=0.0))
    top_backlog = _nice_max(float(max((p.backlog for p in points), default=0)))

    def xy(p: Point, value: float, top: float) -> str:
        x = pad_l + inner_w * min(max((p.at_ms - start) / window_ms, 0.0), 1.0)
        y = pad_t + inner_h * (1 - value / top)
        return f"{x:.1f},{y:.1f}"

    rate_line = " ".join(xy(p, p.rate_per_min, top_rate) for p in points)
    backlog_line = " ".join(xy(p, p.backlog, top_backlog) for p in points)
    base_y = pad_t + inner_h
    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" preserveAspectRatio="none" '
        'aria-label="delivery rate and backlog over the last hour">',
        f'<rect x="{pad_l}" y="{pad_t}" width="{inner_w}" height="{inner_h}" class="chart-frame"/>',
        f'<text x="{pad_l - 4}" y="{pad_t + 10}" text-anchor="end" class="chart-rate">{escape(_fmt(top_rate))}</text>',
        f'<text x="{pad_l - 4}" y="{base_y}" text-anchor="end" class="chart-rate">0</text>',
        f'<text x="{width - pad_r + 4}" y="{pad_t + 10}" class="chart-backlog">{escape(_fmt(top_backlog))}</text>',
        f'<text x="{width - pad_r + 4}" y="{base_y}" class="chart-backlog">0</text>',
        f'<text x="{pad_l}" y="{height - 6}" class="chart-axis">-60 min</text>',
        f'<text x="{width - pad_r}" y="{height - 6}" text-anchor="end" class="chart-axis">now</text>',
    ]
    if points:
        parts.append(f'<polyline points="{rate_line}" class="chart-rate-line"/>')
        parts.append(f'<polyline points="{backlog_line}" class="chart-backlog-line"/>')
    else:
        parts.append(
            f'<text x="{width / 2:.0f}" y="{pad_t + inner_h / 2:.0f}" text-anchor="middle" class="chart-axis">'
            "no samples yet</text>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    step = 1.0
    while step * 10 <= value:
        step *= 10
    for multiple in (1, 2, 5, 10):
        if value <= step * multiple:
            return step * multiple
    return step * 10


def _fmt(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:g}"
