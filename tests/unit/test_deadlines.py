"""``roomservice.futures.Deadlines``: one timer for many futures, each expired at its own deadline."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from roomservice.futures import Deadlines


def _time_out(future: asyncio.Future[Any]) -> None:
    future.set_exception(TimeoutError())


async def test_each_future_expires_at_its_own_deadline_whatever_the_order_they_came_in() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(_time_out)
    start = loop.time()
    late, early, answered = loop.create_future(), loop.create_future(), loop.create_future()
    deadlines.watch(late, start + 0.3)
    deadlines.watch(early, start + 0.05)  # came in after, falls before: the timer is moved up
    deadlines.watch(answered, start + 0.05)
    answered.set_result(None)  # done before its deadline: left alone
    with pytest.raises(TimeoutError):
        await early
    assert loop.time() - start < 0.3 and not late.done()
    with pytest.raises(TimeoutError):
        await late
    assert loop.time() - start >= 0.3 - 0.01
    assert answered.result() is None


async def test_close_stops_the_timer_and_hands_back_what_is_not_done() -> None:
    loop = asyncio.get_running_loop()
    expired: list[asyncio.Future[Any]] = []
    deadlines = Deadlines(expired.append)
    pending, answered = loop.create_future(), loop.create_future()
    deadlines.watch(pending, loop.time() + 0.02)
    deadlines.watch(answered, loop.time() + 0.02)
    answered.set_result(None)
    assert deadlines.close() == [pending]
    await asyncio.sleep(0.05)  # past the deadline: a timer left armed would have expired it
    assert expired == [] and not pending.done()
