"""Commit -> delivered of each event, timed with ``perf_counter`` by a bench (issue 12).

The rows' own ``created_at_ms -> delivered_at_ms`` keeps whole milliseconds and starts when the
command is decided, before its commit. :class:`Timeline` instead times, per event, from the
command's commit notification (``RoomService.on_outbox_commit``, the hook that wakes the worker)
to the return of the worker's transaction that wrote the row's finish, and the steps between:

    submitted -> committed -> claim starts -> claimed -> published -> finish starts -> finish committed

It is attached to a running :class:`~roomservice.bootstrap.Process` from the outside: a hook put
before the worker's wake-up, and wrappers around the worker's repository calls and its
decision step, on those instances only. Nothing in the process behaves differently, except that
each call now also takes a ``perf_counter()`` and a dict write.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from bench.common import percentile

EVENT_TYPE = "RoomUserJoined"
_command: ContextVar[int | None] = ContextVar("bench_timeline_command", default=None)

# (label, from mark, to mark): the steps, then the target's figure
STEPS = (
    ("submitted -> commit notified (decide + group commit)", "submitted", "committed"),
    ("commit -> claim starts (wake-up, loop, linger of the batch before)", "committed", "claim_start"),
    ("claim transaction (writer wait + thread hop)", "claim_start", "claimed"),
    ("claimed -> published (lanes, instant publishers)", "claimed", "published"),
    ("published -> finish starts (finish linger)", "published", "finish_start"),
    ("finish transaction (writer wait + thread hop)", "finish_start", "finish_done"),
)
TOTAL = ("commit -> finish committed", "committed", "finish_done")


class Timeline:
    def __init__(self) -> None:
        self.commands: dict[int, dict[str, float]] = {}  # per command: submitted, committed
        self.keys: dict[int, tuple[str, int]] = {}  # command -> (room_id, version) of its row
        self.rows: dict[tuple[str, int], dict[str, float]] = {}  # (room_id, version) -> marks
        self._row_keys: dict[int, tuple[str, int]] = {}  # row id -> (room_id, version)

    # ------------------------------------------------------------------ attaching

    def attach(self, rt: Any) -> None:
        rt.commands.service.on_outbox_commit.insert(0, self._committed)  # before the worker's wake-up
        worker, repo = rt.worker, rt.worker.repository
        claim_due, finish, finish_and_claim = repo.claim_due, repo.finish, repo.finish_and_claim
        decide: Callable[[list[Any]], Any] = worker._decide

        async def timed_claim_due(**kwargs: Any) -> Any:
            start = time.perf_counter()
            rows = await claim_due(**kwargs)
            self._claimed(rows, start, time.perf_counter())
            return rows

        async def timed_finish(**kwargs: Any) -> Any:
            start = time.perf_counter()
            changed = await finish(**kwargs)
            self._finished(kwargs, start, time.perf_counter())
            return changed

        async def timed_finish_and_claim(**kwargs: Any) -> Any:
            start = time.perf_counter()
            changed, rows = await finish_and_claim(**kwargs)
            end = time.perf_counter()
            self._finished(kwargs, start, end)
            self._claimed(rows, start, end)
            return changed, rows

        def timed_decide(outcomes: list[Any]) -> Any:
            now = time.perf_counter()
            for outcome in outcomes:
                self._mark(outcome.row.id, "published", now)
            return decide(outcomes)

        repo.claim_due, repo.finish, repo.finish_and_claim = timed_claim_due, timed_finish, timed_finish_and_claim
        worker._decide = timed_decide

    async def execute(self, svc: Any, i: int, app: str, room_id: str, command_id: str, command: Any) -> Any:
        """``svc.execute`` for command ``i``, its submission and commit timed."""
        token = _command.set(i)
        self.commands[i] = {"submitted": time.perf_counter()}
        try:
            body = await svc.execute(app, room_id, command_id, command)
        finally:
            _command.reset(token)
        self.keys[i] = (room_id, int(body["version"]))
        return body

    def _committed(self) -> None:
        i = _command.get()
        if i is not None:
            self.commands[i].setdefault("committed", time.perf_counter())

    def _claimed(self, rows: list[Any], start: float, end: float) -> None:
        for row in rows:
            if row.event_type == EVENT_TYPE:
                key = self._row_keys[row.id] = (row.room_id, row.room_version)
                self.rows.setdefault(key, {"claim_start": start, "claimed": end})

    def _finished(self, kwargs: dict[str, Any], start: float, end: float) -> None:
        for d in kwargs["delivered"]:
            self._mark(d.row_id, "finish_start", start)
            self._mark(d.row_id, "finish_done", end)

    def _mark(self, row_id: int, name: str, at: float) -> None:
        key = self._row_keys.get(row_id)
        if key is not None:
            self.rows[key].setdefault(name, at)

    # ------------------------------------------------------------------ figures

    def events(self) -> list[dict[str, float]]:
        """Every command's marks joined with its row's, for the events whose marks are complete."""
        out = []
        for i, marks in self.commands.items():
            key = self.keys.get(i)
            if key is None or key not in self.rows:
                continue
            joined = {**marks, **self.rows[key]}
            if all(name in joined for _, a, b in (*STEPS, TOTAL) for name in (a, b)):
                out.append(joined)
        return out

    def span(self, a: str, b: str) -> list[float]:
        return [(e[b] - e[a]) * 1000 for e in self.events()]

    def total(self) -> list[float]:
        return self.span(TOTAL[1], TOTAL[2])

    def report(self, prefix: str) -> str:
        lines = []
        for label, a, b in (*STEPS, TOTAL):
            ms = self.span(a, b)
            lines.append(
                f"{prefix}   {label:<70} p50 {percentile(ms, 0.5):6.2f}  p90 {percentile(ms, 0.9):6.2f}  "
                f"p99 {percentile(ms, 0.99):6.2f} ms"
            )
        return "\n".join(lines)
