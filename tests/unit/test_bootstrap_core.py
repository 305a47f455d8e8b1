"""Core.cancel_tasks: every background task ends, even one whose first cancellation was lost."""

from __future__ import annotations

import asyncio
import sys
from contextlib import AsyncExitStack
from typing import Any

from structlog.testing import capture_logs

from roomservice.bootstrap.core import Core
from roomservice.config import load_settings


def core() -> Core:
    return Core(settings=load_settings(), db=None, clock=lambda: 0, stack=AsyncExitStack())  # type: ignore[arg-type]


async def test_a_task_whose_cancel_wait_for_swallowed_is_cancelled_again() -> None:
    """The real mechanism: the cancel arrives in the same loop iteration as the awaited result.

    Python 3.11's ``asyncio.wait_for`` then returns the result and the task carries on to
    a long sleep (as asyncmy's reads and a maintenance loop's sleep did); 3.12+ raises at once.
    Either way ``cancel_tasks`` returns with the task cancelled.
    """
    c = core()
    reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    reached: list[str] = []

    async def loop_with_a_database_read() -> None:
        await asyncio.wait_for(reply, timeout=10)
        reached.append("sleep")
        await asyncio.sleep(3600)  # the loop's interval

    c.spawn("maintenance-like", loop_with_a_database_read())
    task = c.tasks[0]
    await asyncio.sleep(0)  # it waits in wait_for
    reply.set_result(1)  # the reply and the stop land in the same iteration
    with capture_logs() as logs:
        await c.cancel_tasks(recancel_after_s=0.01)
    assert task.cancelled()
    assert c.tasks == []
    if sys.version_info < (3, 12):  # the first cancel was swallowed: a second one stopped it
        assert reached == ["sleep"]
        assert [e["event"] for e in logs] == ["background_tasks_cancelled_again"]
        assert logs[0]["tasks"] == ["maintenance-like"]


async def test_a_task_that_swallows_its_cancel_once_is_cancelled_again() -> None:
    c = core()
    swallowed: list[int] = []

    async def swallows_the_first() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.append(1)
        await asyncio.sleep(3600)

    async def plain() -> None:
        await asyncio.sleep(3600)

    c.spawn("swallows", swallows_the_first())
    c.spawn("plain", plain())
    tasks = list(c.tasks)
    await asyncio.sleep(0)
    with capture_logs() as logs:
        await c.cancel_tasks(recancel_after_s=0.01)
    assert swallowed == [1]
    assert all(t.cancelled() for t in tasks)
    assert [(e["event"], e["tasks"]) for e in logs] == [("background_tasks_cancelled_again", ["swallows"])]


async def test_a_task_that_never_stops_is_logged_and_left_behind() -> None:
    c = core()
    stop = asyncio.Event()

    async def refuses() -> None:
        while not stop.is_set():
            try:
                await stop.wait()
            except asyncio.CancelledError:
                continue

    c.spawn("refuses", refuses())
    task = c.tasks[0]
    await asyncio.sleep(0)
    with capture_logs() as logs:
        await c.cancel_tasks(recancel_after_s=0.01, give_up_after_s=0.05)
    assert not task.done() and c.tasks == []  # stopping went on without it
    events: list[dict[str, Any]] = [e for e in logs if e["event"] == "background_tasks_not_stopped"]
    assert [e["tasks"] for e in events] == [["refuses"]]
    stop.set()
    await task
