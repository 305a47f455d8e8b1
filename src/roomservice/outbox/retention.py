"""Retention: delete what delivery no longer needs, in bounded batches, one process at a time.

Delivered outbox rows (and fired treasure timers) older than ``delivered_retention``
go; failed rows are dead letters and are kept until an operator replays them. Only
the process holding the maintenance lock sweeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from roomservice.leases.maintenance import MaintenanceLock
from roomservice.observability.logging import get_logger

_log = get_logger("roomservice.outbox")

LOCK_NAME = "roomservice_outbox_retention"


class Purge(Protocol):
    """Delete up to ``limit`` rows finished before ``before_ms``; return how many went."""

    def __call__(self, *, before_ms: int, limit: int) -> Awaitable[int]: ...


class RetentionSweeper:
    def __init__(
        self,
        lock: MaintenanceLock,
        purges: Sequence[Purge],
        *,
        retention_ms: int,
        batch_size: int,
        clock: Callable[[], int],
        max_batches: int = 100,
        lock_name: str = LOCK_NAME,
    ) -> None:
        self.lock = lock
        self.lock_name = lock_name
        self.purges = purges
        self.retention_ms = retention_ms
        self.batch_size = batch_size
        self.clock = clock
        self.max_batches = max_batches  # bound one sweep per purge; the next sweep continues

    async def sweep(self) -> int:
        """Run every purge batch by batch; 0 when another process holds the lock."""
        if not await self.lock.try_acquire(self.lock_name):
            return 0
        deleted = 0
        try:
            before = self.clock() - self.retention_ms
            for purge in self.purges:
                for _ in range(self.max_batches):
                    n = await purge(before_ms=before, limit=self.batch_size)
                    deleted += n
                    if n < self.batch_size:
                        break
                    await asyncio.sleep(0)  # let commands in between batches
        finally:
            await self.lock.release(self.lock_name)
        if deleted:
            _log.info("outbox_retention_swept", deleted=deleted, retention_ms=self.retention_ms)
        return deleted

    async def run(self, *, interval_s: float) -> None:
        while True:
            try:
                await self.sweep()
            except Exception as exc:
                _log.warning("outbox_retention_failed", error=repr(exc))
            await asyncio.sleep(interval_s)
