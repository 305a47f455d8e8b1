"""Shared write transactions (roomservice.coalesce): calls that arrive together are written together."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import Connection, text

from roomservice.coalesce import Coalesced, HeldBack
from roomservice.store.database import Database


async def test_calls_that_arrive_together_share_one_transaction_and_each_gets_its_result(
    database: Database,
) -> None:
    batches: list[list[int]] = []

    def unit(conn: Connection, items: list[int]) -> list[int]:
        batches.append(list(items))
        conn.execute(text("SELECT 1"))
        return [item * 10 for item in items]

    coalesced: Coalesced[int, int] = Coalesced(database, unit)
    results = await asyncio.gather(*(coalesced.submit(i) for i in range(20)))
    assert results == [i * 10 for i in range(20)]
    assert batches == [list(range(20))]  # one transaction for all twenty
    assert await coalesced.submit(7) == 70  # and the next call starts a new batch
    assert batches[-1] == [7]


async def test_a_failed_transaction_fails_every_call_of_its_batch_and_the_next_batch_runs(database: Database) -> None:
    calls = 0

    def unit(conn: Connection, items: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("the transaction failed")
        return items

    coalesced: Coalesced[int, int] = Coalesced(database, unit)
    outcomes = await asyncio.gather(*(coalesced.submit(i) for i in range(5)), return_exceptions=True)
    assert all(isinstance(o, RuntimeError) for o in outcomes), outcomes
    assert await coalesced.submit(3) == 3


async def test_batches_are_bounded(database: Database) -> None:
    sizes: list[int] = []

    def unit(conn: Connection, items: list[int]) -> list[int]:
        sizes.append(len(items))
        return items

    coalesced: Coalesced[int, int] = Coalesced(database, unit, max_batch=4)
    assert await asyncio.gather(*(coalesced.submit(i) for i in range(10))) == list(range(10))
    assert sizes == [4, 4, 2]


@pytest.mark.parametrize("n", [1, 3])
async def test_a_caller_that_stops_waiting_leaves_the_others_answered(database: Database, n: int) -> None:
    written: list[int] = []

    def unit(conn: Connection, items: list[int]) -> list[int]:
        written.extend(items)
        return items

    coalesced: Coalesced[int, int] = Coalesced(database, unit)
    impatient = asyncio.ensure_future(coalesced.submit(-1))
    patient = [asyncio.ensure_future(coalesced.submit(i)) for i in range(n)]
    await asyncio.sleep(0)  # every call queued, the batch not taken yet
    impatient.cancel()
    assert await asyncio.gather(*patient) == list(range(n))
    assert impatient.cancelled()
    assert written == list(range(n))  # it gave up before its batch was taken: left out, never written


class Starts:
    """A call that records when it starts and answers once the test lets it (or fails for "bad")."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.answer = asyncio.Event()
        self.answer.set()

    async def __call__(self, item: str) -> str:
        self.started.append(item)
        await self.answer.wait()
        if item == "bad":
            raise ValueError(item)
        return item.upper()


async def test_held_back_calls_start_together_once_everyone_under_way_is_held() -> None:
    call, under_way = Starts(), 3
    held = HeldBack(call, linger_s=30, expected=lambda: under_way)
    first = asyncio.create_task(held("a"))
    second = asyncio.create_task(held("bad"))
    await asyncio.sleep(0)
    assert call.started == []  # a third caller is under way: they wait for it
    assert await held("c") == "C"
    assert call.started == ["a", "bad", "c"]
    assert await first == "A"
    with pytest.raises(ValueError, match="bad"):  # each caller hears its own call's outcome
        await second


async def test_a_held_back_call_starts_at_once_alone_and_after_linger_s_at_the_latest() -> None:
    call = Starts()
    assert await HeldBack(call, linger_s=30, expected=lambda: 1)("alone") == "ALONE"
    held = HeldBack(call, linger_s=0.05, expected=lambda: 5)
    waiting = asyncio.create_task(held("late"))
    await asyncio.sleep(0)
    assert call.started == ["alone"]  # held: four others are under way
    assert await asyncio.wait_for(waiting, timeout=10) == "LATE"  # the linger ran out, it went alone


async def test_a_caller_that_stops_waiting_while_held_is_left_out() -> None:
    call = Starts()
    held = HeldBack(call, linger_s=30, expected=lambda: 3)
    gone = asyncio.create_task(held("gone"))
    await asyncio.sleep(0)
    gone.cancel()
    kept = asyncio.create_task(held("kept"))
    await asyncio.sleep(0)
    assert await held("last") == "LAST"
    assert await kept == "KEPT" and call.started == ["kept", "last"]


async def test_a_held_back_call_refused_before_it_starts_fails_alone() -> None:
    started: list[str] = []

    def queue(item: str) -> asyncio.Future[str]:  # queued at once, as Coalesced.submit_nowait queues
        if item == "refused":
            raise ValueError(item)
        started.append(item)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        future.set_result(item.upper())
        return future

    held = HeldBack(queue, linger_s=30, expected=lambda: 2)
    refused = asyncio.create_task(held("refused"))
    await asyncio.sleep(0)
    assert await held("kept") == "KEPT" and started == ["kept"]
    with pytest.raises(ValueError, match="refused"):
        await refused
