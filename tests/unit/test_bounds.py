"""``roomservice.futures.Bounds``: ``asyncio.timeout`` for many blocks, with one timer between them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from roomservice.futures import Bounds, _Bound


def _within(bounds: Bounds, delay: float) -> _Bound:
    """A block bounded ``delay`` seconds from now."""
    return bounds.until(asyncio.get_running_loop().time() + delay)


async def test_a_block_that_ends_in_time_is_left_alone() -> None:
    bounds = Bounds()
    async with _within(bounds, 1.0):
        await asyncio.sleep(0)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_block_past_its_deadline_raises_timeout_and_the_task_goes_on() -> None:
    loop = asyncio.get_running_loop()
    bounds = Bounds()
    start = loop.time()
    with pytest.raises(TimeoutError):
        async with _within(bounds, 0.05):
            await asyncio.sleep(10)
    assert 0.05 - 0.01 <= loop.time() - start < 5
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the cancellation was taken back
    async with _within(bounds, 1.0):  # the same bounds serve the next block
        await asyncio.sleep(0.01)


async def test_each_block_times_out_at_its_own_deadline_and_no_other() -> None:
    loop = asyncio.get_running_loop()
    bounds = Bounds()
    start = loop.time()
    ended: dict[str, Any] = {}

    async def block(name: str, delay: float, work: float) -> None:
        try:
            async with _within(bounds, delay):
                await asyncio.sleep(work)
            ended[name] = "done"
        except TimeoutError:
            ended[name] = round(loop.time() - start, 1)

    await asyncio.gather(
        block("late", 0.3, 10), block("early", 0.1, 10), block("quick", 0.1, 0.01), block("slow ok", 0.5, 0.2)
    )
    assert ended == {"late": 0.3, "early": 0.1, "quick": "done", "slow ok": "done"}


async def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    bounds = Bounds()
    entered = asyncio.Event()

    async def bounded() -> None:
        async with _within(bounds, 10):
            entered.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(bounded())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_blocks_that_end_in_time_share_one_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    call_at = loop.call_at

    def counting(when: float, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        armed.append(when)
        return call_at(when, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", counting)
    bounds = Bounds()
    for _ in range(100):
        async with _within(bounds, 5.0):
            await asyncio.sleep(0)
    assert len(armed) == 1  # asyncio.timeout would have armed (and cancelled) a timer per block



async def test_a_block_bounded_until_an_instant_times_out_at_that_instant_however_late_it_is_entered() -> None:
    loop = asyncio.get_running_loop()
    bounds = Bounds()
    deadline = loop.time() + 0.1
    await asyncio.sleep(0.05)  # entered half-way to it: the block has what is left, not 0.1 s more
    bound = bounds.until(deadline)
    with pytest.raises(TimeoutError):
        async with bound:
            await asyncio.sleep(10)
    assert bound.deadline == deadline
    assert deadline - 0.01 <= loop.time() < deadline + 5  # (the timer is armed for bound.deadline)
