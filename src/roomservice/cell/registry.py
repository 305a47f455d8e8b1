"""CellRegistry: finds or loads the cell of a room, evicts idle cells, and retires fenced ones."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from roomservice.cell.cell import RoomCell
from roomservice.leases.port import LeaseBackendUnavailable, LeaseManager, LeaseUnavailable
from roomservice.observability import metrics as m
from roomservice.observability.logging import get_logger
from roomservice.store.port import RoomStore

_log = get_logger("roomservice.cell")

Key = tuple[str, str]


class CellRegistry:
    """The active cells of this process, one per room.

    Loading is single-flight: concurrent first commands on a room share one
    load, a task of its own that each of them awaits (shielded: a caller that
    goes away, a client gone or a forwarded call's deadline, takes no other
    caller with it; the cell it loaded stays, for the next command or the idle
    sweep). Loading takes the lease first, then bumps the durable fencing epoch,
    then reads snapshot + log — in that order, so a cell never works with an
    epoch older than the state it loaded.
    """

    def __init__(self, *, store: RoomStore, leases: LeaseManager, idle_after_s: float) -> None:
        self._store = store
        self.leases = leases
        self._idle_after_s = idle_after_s
        self._cells: dict[Key, RoomCell] = {}
        self._loading: dict[Key, asyncio.Task[RoomCell]] = {}
        self._releasing: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._cells)

    def peek(self, app_code: str, room_id: str) -> RoomCell | None:
        return self._cells.get((app_code, room_id))

    async def cell(self, app_code: str, room_id: str) -> RoomCell:
        key = (app_code, room_id)
        cell = self._cells.get(key)
        if cell is not None:
            return cell
        loading = self._loading.get(key)
        if loading is None or loading.done():  # (done: its callback has not run yet; its cell, if any, is gone)
            loading = self._loading[key] = asyncio.get_running_loop().create_task(
                self._load_as(key), name=f"room-load:{app_code}/{room_id}"
            )
            # (a callback, not the coroutine's own finally: a task cancelled before it started runs no code)
            loading.add_done_callback(functools.partial(self._loaded, key))
        return await asyncio.shield(loading)

    async def _load_as(self, key: Key) -> RoomCell:
        """The load of ``key``'s cell, registered once loaded."""
        cell = await self._load(*key)
        self._cells[key] = cell
        return cell

    def _loaded(self, key: Key, task: asyncio.Task[RoomCell]) -> None:
        if self._loading.get(key) is task:
            del self._loading[key]
        if not task.cancelled():
            task.exception()  # a load's failure is its callers' to raise; with none left, not left unretrieved

    async def _load(self, app_code: str, room_id: str) -> RoomCell:
        try:
            lease = await self.leases.acquire(app_code, room_id)
        except LeaseUnavailable:
            m.LEASE_REFUSED.inc()
            raise
        except LeaseBackendUnavailable:
            m.LEASE_UNAVAILABLE.inc()
            raise
        m.LEASE_ACQUIRED.inc()
        try:
            epoch = await self._store.take_lease_epoch(app_code, room_id)
            loaded = await self._store.load_room(app_code, room_id)
        except BaseException:
            await self.leases.release(lease)
            raise
        return RoomCell(app_code=app_code, room_id=room_id, state=loaded.state, epoch=epoch, lease=lease)

    async def retire(self, cell: RoomCell, *, lost: str | None = None) -> None:
        """Drop a cell (fenced off, evicted, or holding no room) and give its lease back;
        ``lost`` names how the lease was found lost (``room_lease_losses_total``), if it was."""
        if lost is not None and not cell.retired:
            m.lease_lost(lost)
        cell.retired = True
        key = (cell.app_code, cell.room_id)
        if self._cells.get(key) is cell:
            del self._cells[key]
        await self.leases.release(cell.lease)

    @asynccontextmanager
    async def holding(self, app_code: str, room_id: str) -> AsyncIterator[None]:
        """Hold the room's turn, as a command does: nothing else runs on the room meanwhile. The
        lease is confirmed first, as a command confirms it before its commit: a cell whose lease
        ran out (another process may hold the room now) raises LeaseUnavailable and is retired."""
        for _attempt in range(3):
            cell = await self.cell(app_code, room_id)
            async with cell.turn():
                if cell.retired:  # replaced while we queued: take the fresh one
                    continue
                try:
                    cell.lease = await self.leases.ensure(cell.lease)
                except LeaseUnavailable:
                    await self.retire(cell, lost="ensure")
                    raise
                try:
                    yield
                    return
                finally:  # (only the turn's holder: one still queued knows nothing of the room yet)
                    if cell.state is None and not cell.retired:
                        await self.retire(cell)
        raise LeaseUnavailable(f"{app_code}/{room_id} kept moving")

    async def on_lease_lost(self, app_code: str, room_id: str) -> None:
        """The lease manager's ``on_lost``: the room's lease is gone, so its cell goes too."""
        cell = self._cells.get((app_code, room_id))
        if cell is not None:
            await self.retire(cell, lost="on_lost")

    def discard(self, cell: RoomCell) -> None:
        """Retire ``cell`` at once, from any context (a cancelled task may not await again);
        its lease is given back in the background."""
        cell.retired = True
        key = (cell.app_code, cell.room_id)
        if self._cells.get(key) is cell:
            del self._cells[key]
        task = asyncio.get_running_loop().create_task(self.leases.release(cell.lease))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def evict_idle(self) -> int:
        """Retire cells unused for ``idle_after_s``; returns how many went."""
        deadline = time.monotonic() - self._idle_after_s
        idle = [c for c in self._cells.values() if c.last_used < deadline and not c.busy]
        evicted = 0
        for cell in idle:
            # looked at again: each release before it awaited, and a command may have begun on it meanwhile
            if cell.retired or cell.busy or cell.last_used >= deadline:
                continue
            await self.retire(cell)
            evicted += 1
        if evicted:
            _log.info("cells_evicted", count=evicted, active=len(self._cells))
        return evicted

    async def run_eviction(self, *, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.evict_idle()
            except Exception:  # keep sweeping; a failed release is retried next round
                _log.exception("cell_eviction_failed")

    async def close(self) -> None:
        loading = list(self._loading.values())
        for task in loading:  # a load nobody awaits any more must not register a cell after this
            task.cancel()
        await asyncio.gather(*loading, return_exceptions=True)
        for cell in list(self._cells.values()):
            await self.retire(cell)
