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
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from sqlalchemy import Connection

from roomservice.store.database import Database
from roomservice.store.group_commit import Failed, GroupCommit

__all__ = ["Coalesced", "Failed", "HeldBack"]

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


class HeldBack(Generic[ItemT, ResultT]):
    """Calls that come one after another, a few milliseconds apart, started together.

    A :class:`Coalesced` unit shares a transaction only among calls that arrive
    while the one before is being written: calls that trickle in (the IM bridge's
    records and acks, released one by one by its rate limit) still get a
    transaction each. ``HeldBack(call, ...)(item)`` holds ``item`` back while
    others are under way that will make the same call soon — ``expected()`` says
    how many callers are under way, this one included — and starts the held calls
    together (so they share a transaction) once every caller under way is held,
    or ``linger_s`` after the first was held. With nobody else under way (or
    ``linger_s`` 0) a call starts at once. A caller hears its own call's result;
    one that stops waiting while held is left out, after that the call goes on.
    """

    def __init__(
        self, call: Callable[[ItemT], Awaitable[ResultT]], *, linger_s: float, expected: Callable[[], int]
    ) -> None:
        """``call`` may return a future (queued at once, as ``Coalesced.submit_nowait`` does): the held
        calls then start without a task each."""
        self._call = call
        self._linger_s = linger_s
        self._expected = expected
        self._held: list[tuple[ItemT, asyncio.Future[ResultT]]] = []
        self._timer: asyncio.TimerHandle | None = None

    async def __call__(self, item: ItemT) -> ResultT:
        if self._linger_s <= 0 or (not self._held and self._expected() <= 1):
            return await self._call(item)
        loop = asyncio.get_running_loop()
        held: asyncio.Future[ResultT] = loop.create_future()
        self._held.append((item, held))
        if len(self._held) >= self._expected():
            self._release()
        elif self._timer is None:
            self._timer = loop.call_later(self._linger_s, self._release)
        return await held

    def _release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held, self._held = self._held, []
        for item, future in held:
            if future.done():  # its caller gave up while it was held: never started
                continue
            try:
                started = asyncio.ensure_future(self._call(item))
            except Exception as exc:  # refused before it started: to its caller alone
                future.set_exception(exc)
                continue
            _follow(started, future)


def _follow(call: asyncio.Future[ResultT], caller: asyncio.Future[ResultT]) -> None:
    """``caller`` gets ``call``'s outcome; a caller that stops waiting cancels the call."""

    def forward(done: asyncio.Future[ResultT]) -> None:
        if caller.done():
            return
        if done.cancelled():
            caller.cancel()
        elif (exc := done.exception()) is not None:
            caller.set_exception(exc)
        else:
            caller.set_result(done.result())

    def back(done: asyncio.Future[ResultT]) -> None:
        if done.cancelled() and not call.done():
            call.cancel()

    call.add_done_callback(forward)
    caller.add_done_callback(back)
