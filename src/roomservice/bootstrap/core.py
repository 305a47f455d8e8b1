"""The core every process has: settings, the database, the clock, health checks and background tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from roomservice import errors
from roomservice.config import Settings
from roomservice.health import HealthChecks
from roomservice.observability.logging import get_logger
from roomservice.store.database import Database

_log = get_logger("roomservice.bootstrap")

Check = Callable[[], Coroutine[Any, Any, None]]


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

    async def cancel_tasks(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
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
