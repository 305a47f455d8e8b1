"""CellRegistry: finds or loads the cell of a room, evicts idle cells, and retires fenced ones."""

from __future__ import annotations

import asyncio
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
    load. Loading takes the lease first, then bumps the durable fencing epoch,
    then reads snapshot + log — in that order, so a cell never works with an
    epoch older than the state it loaded.
    """

    def __init__(self, *, store: RoomStore, leases: LeaseManager, idle_after_s: float) -> None:
        self._store = store
        self.leases = leases
        self._idle_after_s = idle_after_s
        self._cells: dict[Key, RoomCell] = {}
        self._loading: dict[Key, asyncio.Future[RoomCell]] = {}
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
        pending = self._loading.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[RoomCell] = asyncio.get_running_loop().create_future()
        self._loading[key] = future
        try:
            cell = await self._load(app_code, room_id)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters (if any) re-raise it themselves
            raise
        finally:
            del self._loading[key]
        self._cells[key] = cell
        future.set_result(cell)
        return cell

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
        """Hold the room's turn, as a command does: nothing else runs on the room meanwhile."""
        for _attempt in range(3):
            cell = await self.cell(app_code, room_id)
            try:
                async with cell.turn():
                    if cell.retired:  # replaced while we queued: take the fresh one
                        continue
                    yield
                    return
            finally:
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
        for cell in idle:
            await self.retire(cell)
        if idle:
            _log.info("cells_evicted", count=len(idle), active=len(self._cells))
        return len(idle)

    async def run_eviction(self, *, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.evict_idle()
            except Exception:  # keep sweeping; a failed release is retried next round
                _log.exception("cell_eviction_failed")

    async def close(self) -> None:
        for cell in list(self._cells.values()):
            await self.retire(cell)
