"""The core every process has: settings, the database, the clock, health checks and background tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final

from roomservice import errors
from roomservice.config import Settings
from roomservice.health import HealthChecks
from roomservice.observability.logging import get_logger
from roomservice.store.database import Database

_log = get_logger("roomservice.bootstrap")

Check = Callable[[], Coroutine[Any, Any, None]]

RECANCEL_AFTER_S: Final = 1.0  # a task cancelled this long ago and still running lost its cancel (cancel_tasks)
GIVE_UP_AFTER_S: Final = 5.0  # stopping goes on without a task that outlives this (logged)


class PartNotRunning(errors.Unavailable):
    """A health check found an in-process part stopped."""


@dataclass(slots=True)
class Core:
    settings: Settings
    db: Database
    clock: Callable[[], int]
    stack: AsyncExitStack
    health: HealthChecks = field(default_factory=HealthChecks)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background until the process stops; a crash is logged."""
        self.track(asyncio.create_task(coro, name=name))

    def track(self, task: asyncio.Task[None]) -> None:
        task.add_done_callback(_report_crash)
        self.tasks.append(task)

    async def cancel_tasks(
        self, *, recancel_after_s: float = RECANCEL_AFTER_S, give_up_after_s: float = GIVE_UP_AFTER_S
    ) -> None:
        """Cancel every background task and wait for them to end.

        On Python 3.11 a cancellation can be lost: ``asyncio.wait_for`` returns the
        awaited result when the cancel arrives in the same loop iteration as that
        result (CPython gh-86296, fixed in 3.12 by rebuilding ``wait_for`` on
        ``asyncio.timeout``), and asyncmy reads every MariaDB reply through
        ``wait_for`` when a read timeout is set, as ours is. A loop cancelled inside
        a database call then goes on to its next sleep as if never asked to stop
        (a maintenance sweep sleeps 60 s, and did: a worker stopped right after
        starting hung). So a task still running ``recancel_after_s`` after the
        cancel is cancelled again, every ``recancel_after_s``; one still running
        after ``give_up_after_s`` is logged and left behind, and stopping goes on.
        """
        pending = set(self.tasks)
        for task in pending:
            task.cancel()
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + give_up_after_s
        while pending:
            _, pending = await asyncio.wait(pending, timeout=max(0.0, min(recancel_after_s, give_up_at - loop.time())))
            if not pending:
                break
            if loop.time() >= give_up_at:
                _log.warning("background_tasks_not_stopped", tasks=sorted(t.get_name() for t in pending))
                break
            _log.info("background_tasks_cancelled_again", tasks=sorted(t.get_name() for t in pending))
            for task in pending:
                task.cancel()
        self.tasks.clear()


def ms(value: timedelta) -> int:
    return int(value.total_seconds() * 1000)


def alive_check(name: str, alive: Callable[[], bool]) -> Check:
    async def check() -> None:
        if not alive():
            raise PartNotRunning(f"{name} is not running")

    return check


def _report_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        _log.error("background_task_crashed", task=task.get_name(), error=repr(task.exception()))
