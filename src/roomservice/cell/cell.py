"""RoomCell: the in-memory owner of one room's state.

Commands on one room run one at a time (``async with cell.turn()``); each is
decided on the current state, committed, and only then applied. The cell also
remembers the most recent command ids it committed so most idempotency checks
need no database round trip.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from types import TracebackType

from roomservice.domain.state import RoomState
from roomservice.leases.port import Lease
from roomservice.store.port import LoggedCommand

RECENT_COMMANDS = 64


class RoomCell:
    __slots__ = ("_lock", "_recent", "app_code", "epoch", "last_used", "lease", "retired", "room_id", "state")

    def __init__(self, *, app_code: str, room_id: str, state: RoomState | None, epoch: int, lease: Lease) -> None:
        self.app_code = app_code
        self.room_id = room_id
        self.state = state
        self.epoch = epoch
        self.lease = lease
        self.last_used = time.monotonic()
        self.retired = False  # set when evicted or fenced off; a retired cell takes no more commands
        self._lock = asyncio.Lock()
        self._recent: OrderedDict[str, LoggedCommand] = OrderedDict()

    def turn(self) -> _Turn:
        """Hold the room for one command (``async with cell.turn():``); FIFO among waiters."""
        return _Turn(self)

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def remembered(self, command_id: str) -> LoggedCommand | None:
        return self._recent.get(command_id)

    def remember(self, logged: LoggedCommand) -> None:
        self._recent[logged.command_id] = logged
        if len(self._recent) > RECENT_COMMANDS:
            self._recent.popitem(last=False)

    def commit(self, state: RoomState | None, logged: LoggedCommand) -> None:
        """Apply a committed command's outcome."""
        self.state = state
        self.remember(logged)


class _Turn:
    """One command's hold on a cell: its lock, taken on entry and released on exit.

    A class, not an ``asynccontextmanager``: every command takes one, and the generator machinery
    (a generator, its wrapper, two ``anext`` round trips) cost more than the lock itself (issue 12).
    """

    __slots__ = ("_cell",)

    def __init__(self, cell: RoomCell) -> None:
        self._cell = cell

    async def __aenter__(self) -> None:
        await self._cell._lock.acquire()
        self._cell.last_used = time.monotonic()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._cell._lock.release()
