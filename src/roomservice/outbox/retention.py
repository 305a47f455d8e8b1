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
        self.behind = False  # the last sweep stopped at max_batches with work left: the next comes soon

    async def sweep(self) -> int:
        """Run every purge batch by batch; 0 when another process holds the lock."""
        if not await self.lock.try_acquire(self.lock_name):
            return 0
        deleted = 0
        behind = False
        try:
            before = self.clock() - self.retention_ms
            for purge in self.purges:
                try:
                    for _ in range(self.max_batches):
                        n = await purge(before_ms=before, limit=self.batch_size)
                        deleted += n
                        if n < self.batch_size:
                            break
                        await asyncio.sleep(0)  # let commands in between batches
                    else:
                        behind = True
                except Exception as exc:  # this purge waits for the next sweep; the others go on
                    _log.warning("retention_purge_failed", lock=self.lock_name, error=repr(exc))
        finally:
            await self.lock.release(self.lock_name)
        self.behind = behind
        if deleted:
            _log.info("outbox_retention_swept", lock=self.lock_name, deleted=deleted, retention_ms=self.retention_ms)
        return deleted

    async def run(self, *, interval_s: float, behind_interval_s: float = 1.0) -> None:
        """Sweep every ``interval_s``; after a sweep that stopped with work left, again in
        ``behind_interval_s`` (a fixed pause after a bounded sweep capped the rate it could delete at)."""
        while True:
            try:
                await self.sweep()
            except Exception as exc:
                self.behind = False
                _log.warning("outbox_retention_failed", error=repr(exc))
            await asyncio.sleep(min(interval_s, behind_interval_s) if self.behind else interval_s)
