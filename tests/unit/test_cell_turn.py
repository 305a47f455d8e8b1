"""RoomCell.turn: one command at a time on a room, in arrival order; the hold ends however the command ends."""

from __future__ import annotations

import asyncio
import math

import pytest

from roomservice.cell.cell import RoomCell
from roomservice.leases.port import Lease


def _cell() -> RoomCell:
    return RoomCell(app_code="a", room_id="r", state=None, epoch=1, lease=Lease("a", "r", "t", math.inf))


async def test_turns_run_one_at_a_time_in_arrival_order() -> None:
    cell = _cell()
    order: list[str] = []
    release, entered = asyncio.Event(), asyncio.Event()

    async def command(name: str) -> None:
        async with cell.turn():
            order.append(f"{name} in")
            if name == "first":
                entered.set()
                await release.wait()
            order.append(f"{name} out")

    tasks = [asyncio.create_task(command(name)) for name in ("first", "second", "third")]
    await entered.wait()
    assert cell.busy and order == ["first in"]
    release.set()
    await asyncio.gather(*tasks)
    assert order == ["first in", "first out", "second in", "second out", "third in", "third out"]
    assert not cell.busy


async def test_a_failed_or_cancelled_command_gives_the_cell_back() -> None:
    cell = _cell()
    with pytest.raises(RuntimeError):
        async with cell.turn():
            raise RuntimeError("decide failed")
    assert not cell.busy

    held = asyncio.Event()

    async def stuck() -> None:
        async with cell.turn():
            held.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(stuck())
    await held.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not cell.busy
    async with cell.turn():
        assert cell.busy
