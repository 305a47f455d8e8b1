"""Shared write transactions: calls that arrive while the previous batch is being written share the next one.

SQLite has one writer: many small write transactions (one per published
message, per acknowledged delivery, per consumed event) queue on it one after
the other, each with its own thread hop and commit. A :class:`Coalesced` unit
writes whatever queued meanwhile in one transaction instead. The queue is the
store's group commit (:class:`~roomservice.store.group_commit.GroupCommit`, which
SaveMutation uses for commands) bound to one ``Database.run_write`` unit — or,
with ``read=True``, to one ``Database.run_read`` unit: small reads that arrive
together (a consumer's dedup look-ups for the deliveries of one fetch) share one
thread hop and one connection checkout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from sqlalchemy import Connection

from roomservice.store.database import Database
from roomservice.store.group_commit import Failed, GroupCommit

__all__ = ["Coalesced", "Failed"]

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")


class Coalesced(Generic[ItemT, ResultT]):
    """Calls that arrive while the previous batch is being written go together into the next one.

    ``unit(conn, items)`` runs a batch's items in order in ONE write transaction
    and returns one result per item; every caller hears its own result only
    after that transaction committed. An item that fails alone (inside its own
    savepoint) is a :class:`Failed` result, raised to its caller only. If the
    transaction fails, every call of the batch fails with the error (none of
    them committed). There is no deadline of its own: ``run_write`` bounds each
    transaction, and a caller may bound its wait; one that stops waiting before
    its batch is taken is left out of it, after that its outcome is unknown.
    """

    def __init__(
        self,
        db: Database,
        unit: Callable[[Connection, list[ItemT]], Sequence[ResultT | Failed]],
        *,
        max_batch: int = 256,
        read: bool = False,
    ) -> None:
        """``read``: ``unit`` only reads, on a read connection (``run_read``), and a caller hears
        its result as soon as the read is done."""
        run = db.run_read if read else db.run_write

        async def commit_batch(items: list[ItemT]) -> Sequence[ResultT | Failed]:
            return await run(unit, items)

        self._queue: GroupCommit[ItemT, ResultT] = GroupCommit(
            commit_batch, lanes=1, max_batch=max_batch, timeout_s=None
        )

    async def submit(self, item: ItemT) -> ResultT:
        return await self._queue.save(item)

    def submit_nowait(self, item: ItemT) -> asyncio.Future[ResultT]:
        """Queue ``item`` now, behind every item submitted before it (they commit in that order, in
        one transaction or in order across several); the future is its result after the commit."""
        return self._queue.enqueue(item)
