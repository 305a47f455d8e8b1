"""Group commit: mutations of different rooms that arrive together share one write transaction.

The queue and its answers live here; what one shared transaction does is the
backend's (``commit_batch``, in :mod:`roomservice.store.sql`). The rules, on
every backend:

* A caller is answered only after the transaction that holds its mutation has
  committed (or failed): never before the shared COMMIT.
* ``commit_batch`` returns one result per mutation: its value, or :class:`Failed`
  with the exception that mutation alone failed with (a stale version or lease
  epoch, a reused command_id): a mutation that fails fails alone, the others commit.
* When the shared transaction itself fails (the database did not answer, the
  COMMIT failed), every caller in it gets that error: a write whose outcome is
  unknown, so each cell is reloaded.
* Each caller's wait (queue plus transaction) has a deadline (the store's: the
  database deadline ``D``; ``None``: the caller brings its own). A
  caller that gave up (deadline, cancelled) before its batch was taken is left
  out of it; once taken, its outcome stands in the database whatever it was told.

A room's cell submits one mutation at a time, so one batch holds at most one
mutation per room. ``lanes`` shared transactions may be in flight at once: 1 for
SQLite (one writer), a few for MySQL/MariaDB, where the transactions of
different rooms do not wait for each other; a mutation that arrives while every
lane is busy waits for the next free one and goes with whatever queued beside it.

The same queue serves other small writes that pile up on SQLite's one writer
(embedded broker publishes and acks, consumers' records): :mod:`roomservice.coalesce`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from roomservice.futures import Deadlines
from roomservice.store.port import StoreDeadlineExceeded, StoreUnavailable

U = TypeVar("U")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Failed:
    """One unit's result when it failed alone (the others of its batch committed): raised to its caller."""

    error: Exception


CommitBatch = Callable[[list[U]], Awaitable[Sequence["R | Failed"]]]


class GroupCommit(Generic[U, R]):
    """The queue of mutations waiting for a shared transaction, and who gets which answer."""

    def __init__(
        self, commit_batch: CommitBatch[U, R], *, lanes: int, max_batch: int, timeout_s: float | None
    ) -> None:
        if lanes < 1 or max_batch < 1:
            raise ValueError("lanes and max_batch must be at least 1")
        self._commit_batch = commit_batch
        self._lanes = lanes
        self._max_batch = max_batch
        self._timeout_s = timeout_s
        self._queue: list[tuple[U, asyncio.Future[R]]] = []
        self._drainers: set[asyncio.Task[None]] = set()  # held so a task is not collected mid-run
        # save()'s deadlines: ONE timer for the earliest, not an asyncio.timeout (a timer armed and
        # cancelled) per command
        self._deadlines = Deadlines(self._expired)
        self.transactions = 0  # shared transactions started
        self.mutations = 0  # mutations they carried

    async def save(self, unit: U) -> R:
        """Queue ``unit`` and return its result once the transaction that carried it committed;
        raise its failure."""
        future = self.enqueue(unit)
        if self._timeout_s is not None:
            self._deadlines.watch(future, future.get_loop().time() + self._timeout_s)
        # past the deadline the future fails (_expired), cancelled with its caller it is cancelled:
        # either way it is done, and a batch not taken yet skips it
        return await future

    def _expired(self, future: asyncio.Future[R]) -> None:
        future.set_exception(StoreDeadlineExceeded(f"database call exceeded its {self._timeout_s:g}s deadline"))

    def enqueue(self, unit: U) -> asyncio.Future[R]:
        """Queue ``unit`` now, behind every unit queued before it; the future is its result once the
        transaction that carried it committed, or its failure. No deadline: the caller bounds its wait,
        and cancelling the future before its batch is taken leaves the unit out."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._queue.append((unit, future))
        if len(self._drainers) < self._lanes:
            task = loop.create_task(self._drain(), name="store-group-commit")
            self._drainers.add(task)
        return future

    def _take(self) -> list[tuple[U, asyncio.Future[R]]]:
        """The next batch: up to ``max_batch`` queued mutations whose callers still wait."""
        batch: list[tuple[U, asyncio.Future[R]]] = []
        while self._queue and len(batch) < self._max_batch:
            room = self._max_batch - len(batch)
            taken, self._queue = self._queue[:room], self._queue[room:]
            batch.extend(entry for entry in taken if not entry[1].done())
        return batch

    async def _drain(self) -> None:
        me = asyncio.current_task()
        assert me is not None
        try:
            while batch := self._take():
                self.transactions += 1
                self.mutations += len(batch)
                try:
                    outcomes = await self._commit_batch([unit for unit, _ in batch])
                except BaseException as exc:  # the shared transaction failed: nobody committed for sure
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    continue
                for (_, future), outcome in zip(batch, outcomes, strict=True):
                    if future.done():  # its caller gave up; the outcome stands in the database
                        continue
                    if isinstance(outcome, Failed):
                        future.set_exception(outcome.error)
                    else:
                        future.set_result(outcome)
        except asyncio.CancelledError:
            if len(self._drainers) == 1:  # the last lane, cancelled (shutdown): nobody takes the rest
                for _, future in self._queue:
                    if not future.done():
                        future.set_exception(StoreUnavailable("the store is shutting down"))
                self._queue.clear()
            raise
        finally:
            # at once, not in a done-callback: a save() queued after the last _take() must see a free lane
            self._drainers.discard(me)
