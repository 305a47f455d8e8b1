"""GroupCommit: the deadline of each caller's wait (queue plus transaction), kept by one timer."""

from __future__ import annotations

import asyncio

import pytest

from roomservice.store.group_commit import GroupCommit
from roomservice.store.port import StoreDeadlineExceeded


class Gate:
    """commit_batch that records its batches and holds each until released."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def commit(self, units: list[str]) -> list[str]:
        self.batches.append(units)
        self.started.set()
        await self.release.wait()
        return [unit.upper() for unit in units]


async def test_a_caller_past_its_deadline_fails_and_its_unit_is_left_out_if_not_taken_yet() -> None:
    gate = Gate()
    gc: GroupCommit[str, str] = GroupCommit(gate.commit, lanes=1, max_batch=10, timeout_s=0.05)
    first = asyncio.ensure_future(gc.save("a"))  # taken at once, its transaction held open
    await gate.started.wait()
    queued = asyncio.ensure_future(gc.save("b"))  # waits for the lane, never taken in time
    for caller in (first, queued):
        with pytest.raises(StoreDeadlineExceeded, match=r"0\.05s deadline"):
            await caller
    gate.release.set()
    assert await gc.save("c") == "C"  # the lane goes on; "b", given up, went nowhere
    assert gate.batches == [["a"], ["c"]]


async def test_deadlines_fall_each_caller_its_own_and_answered_callers_are_not_failed() -> None:
    gate = Gate()
    gc: GroupCommit[str, str] = GroupCommit(gate.commit, lanes=1, max_batch=10, timeout_s=0.2)
    loop = asyncio.get_running_loop()
    first = asyncio.ensure_future(gc.save("a"))
    await gate.started.wait()
    gate.release.set()
    assert await first == "A"  # answered before its deadline: stays answered
    gate.release.clear()
    gate.started.clear()
    t0 = loop.time()
    late = asyncio.ensure_future(gc.save("b"))  # a later deadline than the answered one's
    await gate.started.wait()
    with pytest.raises(StoreDeadlineExceeded):
        await late
    assert loop.time() - t0 >= 0.2 - 0.01  # its own deadline, not the earlier caller's
    gate.release.set()


async def test_a_cancelled_caller_is_left_out_and_the_others_still_have_their_deadline() -> None:
    gate = Gate()
    gc: GroupCommit[str, str] = GroupCommit(gate.commit, lanes=1, max_batch=10, timeout_s=5.0)
    first = asyncio.ensure_future(gc.save("a"))
    await gate.started.wait()
    gone = asyncio.ensure_future(gc.save("b"))
    kept = asyncio.ensure_future(gc.save("c"))
    await asyncio.sleep(0)  # both queued
    gone.cancel()
    gate.release.set()
    assert await first == "A"
    assert await kept == "C"
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert gate.batches == [["a"], ["c"]]


async def test_without_a_timeout_the_caller_bounds_its_own_wait() -> None:
    gate = Gate()
    gc: GroupCommit[str, str] = GroupCommit(gate.commit, lanes=1, max_batch=10, timeout_s=None)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await gc.save("a")
    gate.release.set()
    assert await gc.save("b") == "B"
