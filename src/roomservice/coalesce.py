"""Shared write transactions: calls that arrive while the previous batch is being written share the next one.

SQLite has one writer: many small write transactions (one per published
message, per acknowledged delivery, per consumed event) queue on it one after
the other, each with its own thread hop and commit. A :class:`Coalesced` unit
writes whatever queued meanwhile in one transaction instead (the store's
SaveMutation group commit does the same for commands, in ``store/sql.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from sqlalchemy import Connection

from roomservice.store.database import Database
from roomservice.store.port import StoreUnavailable

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")


@dataclass(frozen=True, slots=True)
class Failed:
    """A unit's result for one item that failed alone (its savepoint rolled back): raised to its caller."""

    error: Exception


class Coalesced(Generic[ItemT, ResultT]):
    """Calls that arrive while the previous batch is being written go together into the next one.

    ``unit(conn, items)`` runs a batch's items in order in ONE write transaction
    and returns one result per item; every caller hears its own result only
    after that transaction committed. An item that fails alone (inside its own
    savepoint) is a :class:`Failed` result, raised to its caller only. If the
    transaction fails, every call of the batch fails with the error (none of
    them committed). A caller that stops waiting (a timeout) does not take its
    item out of a batch already being written: as with a single write, its
    outcome is then unknown.
    """

    def __init__(
        self,
        db: Database,
        unit: Callable[[Connection, list[ItemT]], Sequence[ResultT | Failed]],
        *,
        max_batch: int = 256,
    ) -> None:
        self._db = db
        self._unit = unit
        self._max_batch = max_batch
        self._queue: list[tuple[ItemT, asyncio.Future[ResultT]]] = []
        self._drainer: asyncio.Task[None] | None = None  # held so the task is not collected mid-run

    async def submit(self, item: ItemT) -> ResultT:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[ResultT] = loop.create_future()
        self._queue.append((item, future))
        if self._drainer is None:
            self._drainer = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
                try:
                    results = await self._db.run_write(self._unit, [item for item, _ in batch])
                except BaseException as exc:  # the transaction failed: nobody's item committed
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    continue
                for (_, future), result in zip(batch, results, strict=True):
                    if future.done():  # its caller stopped waiting
                        continue
                    if isinstance(result, Failed):
                        future.set_exception(result.error)
                    else:
                        future.set_result(result)
        finally:
            self._drainer = None
            for _, future in self._queue:  # only after a cancellation (shutdown)
                if not future.done():
                    future.set_exception(StoreUnavailable("shutting down: not written"))
            self._queue.clear()
