"""Retention: delete delivered rows older than ``delivered_retention`` in bounded batches.

Only one process at a time sweeps (the repository's maintenance lock); failed
rows are dead letters and are kept until an operator replays them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from roomservice.observability.logging import get_logger

_log = get_logger("roomservice.outbox")

LOCK_NAME = "roomservice_outbox_retention"


class RetentionRepository(Protocol):
    async def delete_delivered(self, *, before_ms: int, limit: int) -> int: ...

    async def try_maintenance_lock(self, name: str) -> bool: ...

    async def release_maintenance_lock(self, name: str) -> None: ...


class RetentionSweeper:
    def __init__(
        self,
        repository: RetentionRepository,
        *,
        retention_ms: int,
        batch_size: int,
        clock: Callable[[], int],
        max_batches: int = 100,
    ) -> None:
        self.repository = repository
        self.retention_ms = retention_ms
        self.batch_size = batch_size
        self.clock = clock
        self.max_batches = max_batches  # bound one sweep; the next sweep continues

    async def sweep(self) -> int:
        """Delete old delivered rows, batch by batch; 0 when another process holds the lock."""
        if not await self.repository.try_maintenance_lock(LOCK_NAME):
            return 0
        deleted = 0
        try:
            before = self.clock() - self.retention_ms
            for _ in range(self.max_batches):
                n = await self.repository.delete_delivered(before_ms=before, limit=self.batch_size)
                deleted += n
                if n < self.batch_size:
                    break
                await asyncio.sleep(0)  # let commands in between batches
        finally:
            await self.repository.release_maintenance_lock(LOCK_NAME)
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
