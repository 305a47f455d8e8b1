"""started / within: an awaitable run up to its first wait goes on exactly as awaiting it would
have; ``within`` bounds only what has to wait."""

from __future__ import annotations

import asyncio

import pytest

from roomservice.futures import Started, started, within


async def test_started_returns_the_result_of_an_awaitable_that_did_not_wait() -> None:
    async def ready() -> int:
        return 7

    assert started(ready()) == 7


async def test_a_started_awaitable_goes_on_where_it_waited() -> None:
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def waits() -> int:
        return await gate + 1

    pending = started(waits())
    assert isinstance(pending, Started)
    asyncio.get_running_loop().call_soon(gate.set_result, 41)
    assert await pending == 42


async def test_a_cancellation_reaches_the_started_awaitable() -> None:
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    seen: list[str] = []

    async def waits() -> int:
        try:
            return await gate
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    pending = started(waits())
    assert isinstance(pending, Started)

    async def await_it() -> int:
        return await pending

    task = asyncio.create_task(await_it())
    await asyncio.sleep(0)  # one turn: the task now waits on the gate
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled"]
    assert gate.cancelled()


async def test_within_answers_what_did_not_wait_without_a_timer() -> None:
    loop = asyncio.get_running_loop()
    timers = len(loop._scheduled)  # type: ignore[attr-defined]

    async def ready() -> str:
        assert len(loop._scheduled) == timers  # type: ignore[attr-defined]
        return "at once"

    assert await within(ready(), 5) == "at once"


async def test_within_bounds_what_waits() -> None:
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await within(never, 0.02)
    assert never.cancelled()


async def test_within_answers_what_waits_in_time_and_raises_its_errors() -> None:
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(gate.set_result, 3)
    assert await within(gate, 5) == 3

    async def fails_at_once() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        await within(fails_at_once(), 5)
