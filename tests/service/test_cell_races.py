"""Room Cells under cancellation and eviction: a caller that goes away, or a sweep that runs meanwhile,
affects no other command (found by review; each test fails on the code before its fix)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tests.service.helpers import APP, run

from roomservice.bootstrap import Process
from roomservice.domain import commands as c


async def open_room(rt: Process, room: str) -> None:
    await run(rt, room, f"{room}-create", c.CreateRoom(owner_id="owner", title="Room"))


class Gate:
    """Holds a call at its start until opened; says when one got there."""

    def __init__(self) -> None:
        self.reached = asyncio.Event()
        self.opened = asyncio.Event()

    async def hold(self) -> None:
        self.reached.set()
        await self.opened.wait()


def hold_save(runtime: Process, monkeypatch: pytest.MonkeyPatch, command_id: str) -> Gate:
    """A gate at the start of ``command_id``'s save (its turn held, mid-commit)."""
    gate = Gate()
    save_mutation = runtime.store.save_mutation

    async def held_save(mutation: Any) -> Any:
        if mutation.command_id == command_id:
            await gate.hold()
        return await save_mutation(mutation)

    monkeypatch.setattr(runtime.store, "save_mutation", held_save)
    return gate


async def test_a_caller_cancelled_while_its_room_loads_takes_no_one_else_with_it(
    runtime: Process, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first command on a room not loaded runs the load; others wait for it. The first caller
    going away (a client gone, a forwarded call's deadline) used to hand its cancellation to them all."""
    await open_room(runtime, "r1")
    registry = runtime.registry
    cell = registry.peek(APP, "r1")
    assert cell is not None
    await registry.retire(cell)  # the next command loads the room again
    gate = Gate()
    load_room = runtime.store.load_room

    async def slow_load(app_code: str, room_id: str) -> Any:
        await gate.hold()
        return await load_room(app_code, room_id)

    monkeypatch.setattr(runtime.store, "load_room", slow_load)
    first = asyncio.create_task(run(runtime, "r1", "ja", c.JoinRoom(user_id="alice")))
    await gate.reached.wait()
    cell_of = registry.cell
    second_waits = asyncio.Event()

    async def noted_cell(app_code: str, room_id: str) -> Any:
        second_waits.set()  # (the load is in flight: this caller waits for it)
        return await cell_of(app_code, room_id)

    monkeypatch.setattr(registry, "cell", noted_cell)
    second = asyncio.create_task(run(runtime, "r1", "jb", c.JoinRoom(user_id="bob")))
    await second_waits.wait()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    gate.opened.set()
    answer = await second  # bob's join goes on: it was never cancelled
    assert "bob" in [m["user_id"] for m in answer["room"]["members"]]


async def test_an_idle_sweep_leaves_a_cell_that_got_busy_meanwhile(
    runtime: Process, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep lists the idle cells, then gives their leases back one by one; a command that started
    on a later one meanwhile used to lose its cell (and lease) mid-command and answer 503 retry."""
    await open_room(runtime, "r1")
    await open_room(runtime, "r2")
    registry = runtime.registry
    registry._idle_after_s = -10.0  # every cell idle by the clock
    slow_release = Gate()
    release = registry.leases.release

    async def release_r1_slowly(lease: Any) -> None:
        if lease.room_id == "r1":
            await slow_release.hold()  # a slow round trip to Redis, say
        await release(lease)

    monkeypatch.setattr(registry.leases, "release", release_r1_slowly)
    sweep = asyncio.create_task(registry.evict_idle())
    await slow_release.reached.wait()  # r1 and r2 listed; r1's lease on its way back
    slow_save = hold_save(runtime, monkeypatch, "x")
    x = asyncio.create_task(run(runtime, "r2", "x", c.JoinRoom(user_id="xavier")))
    await slow_save.reached.wait()  # x holds r2's turn, mid-commit
    slow_release.opened.set()
    assert await sweep == 1  # r1 only: r2 was busy by the time its turn in the sweep came
    assert registry.peek(APP, "r2") is not None
    slow_save.opened.set()
    answer = await x
    assert answer["version"] == 2


async def test_a_command_cancelled_in_the_queue_leaves_the_cell_of_a_room_being_created(
    runtime: Process, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command queued behind a CreateRoom still committing sees no room yet; cancelled there, it used
    to retire the cell (and give the lease back) under the creation: the next join answered 404."""
    slow_save = hold_save(runtime, monkeypatch, "create")
    create = asyncio.create_task(run(runtime, "r9", "create", c.CreateRoom(owner_id="owner", title="T")))
    await slow_save.reached.wait()
    cell = runtime.registry.peek(APP, "r9")
    assert cell is not None and cell.busy
    queued = asyncio.create_task(run(runtime, "r9", "ja", c.JoinRoom(user_id="alice")))
    while not cell._lock._waiters:  # (queued behind the creation: asyncio.Lock's waiters)
        await asyncio.sleep(0)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert runtime.registry.peek(APP, "r9") is cell and not cell.retired
    slow_save.opened.set()
    assert (await create)["version"] == 1
    joined = await run(runtime, "r9", "jc", c.JoinRoom(user_id="carol"))
    assert joined["version"] == 2


async def test_a_load_that_close_cancels_before_it_began_leaves_nothing_behind(runtime: Process) -> None:
    """A load cancelled before its first step runs none of its code: its entry must still go, or every
    later command on the room would await the cancelled load."""
    registry = runtime.registry
    waiter = asyncio.create_task(registry.cell(APP, "r5"))
    await asyncio.sleep(0)  # the waiter's step: the load's task is made, not begun
    assert (APP, "r5") in registry._loading
    await registry.close()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert registry._loading == {}
