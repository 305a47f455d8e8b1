"""The maintenance role: retention sweeps, command-log pruning and backlog metrics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from roomservice.admin.operations import OutboxAdmin
from roomservice.bootstrap.commands import Commands
from roomservice.bootstrap.core import Core, ms
from roomservice.brokers.embedded import EmbeddedBroker
from roomservice.brokers.port import Broker
from roomservice.consumers.dedup_retention import dedup_purges, dedup_sweeper
from roomservice.leases.leader import RedisMaintenanceLock
from roomservice.leases.maintenance import DatabaseMaintenanceLock
from roomservice.observability.logging import get_logger
from roomservice.observability.metrics import OUTBOX_BACKLOG, OUTBOX_OLDEST_PENDING_SECONDS, sample_db_pool
from roomservice.outbox.retention import RetentionSweeper
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.timers.treasure import DatabaseTreasureTimer

_log = get_logger("roomservice.maintenance")

BROKER_RETENTION_LOCK = "roomservice_broker_retention"
SNAPSHOT_ROOMS_A_PASS = 100  # quiet rooms snapshotted by one command-log pruning pass (more: the next pass soon)


@dataclass(slots=True)
class Maintenance:
    retention: RetentionSweeper
    commands: Commands
    outbox_admin: OutboxAdmin
    dedup_retention: RetentionSweeper
    broker_retention: RetentionSweeper | None = None

    def start(self, core: Core) -> None:
        core.spawn("outbox-retention", self.retention.run(interval_s=60.0))
        core.spawn("dedup-retention", self.dedup_retention.run(interval_s=60.0))
        if self.broker_retention is not None:
            core.spawn("broker-retention", self.broker_retention.run(interval_s=60.0))
        core.spawn("command-log-retention", self._prune_command_log(core, interval_s=300.0))
        if core.settings.metrics.enabled:  # the gauges exist only for GET /metrics
            core.spawn("outbox-backlog-metrics", self._sample_backlog(core, interval_s=15.0))

    async def _prune_command_log(self, core: Core, *, interval_s: float, batch_size: int = 1000) -> None:
        """Drop idempotency records older than room.idempotency_retention, in bounded batches."""
        retention_ms = ms(core.settings.room.idempotency_retention)
        store = self.commands.store
        while True:
            behind = False
            try:
                before = core.clock() - retention_ms
                # rooms too quiet to have been snapshotted by their commands: snapshotted here, or their
                # old rows could never go (and every prune batch would scan them again)
                limit = SNAPSHOT_ROOMS_A_PASS
                behind = await store.snapshot_uncovered(before_ms=before, limit=limit, now_ms=core.clock()) == limit
                for _ in range(100):  # bounded per pass; the next pass continues
                    if await store.prune_command_log(before_ms=before, batch_size=batch_size) < batch_size:
                        break
                    await asyncio.sleep(0)  # commands in between batches
                else:
                    behind = True  # the next pass at once: a fixed pause capped pruning at ~333 rows/s
            except Exception as exc:
                _log.warning("command_log_prune_failed", error=repr(exc))
            await asyncio.sleep(1.0 if behind else interval_s)

    async def _sample_backlog(self, core: Core, *, interval_s: float) -> None:
        while True:
            sample_db_pool(core.db.engine)
            try:
                stats = await self.outbox_admin.stats()
                for status, count in stats.counts.items():
                    OUTBOX_BACKLOG.labels(status).set(count)
                OUTBOX_OLDEST_PENDING_SECONDS.set((stats.oldest_pending_age_ms or 0) / 1000)
            except Exception as exc:
                _log.warning("outbox_backlog_sample_failed", error=repr(exc))
            await asyncio.sleep(interval_s)


def build_maintenance(
    core: Core,
    *,
    commands: Commands,
    repository: SqlOutboxRepository,
    timer: DatabaseTreasureTimer,
    outbox_admin: OutboxAdmin,
    broker: Broker | None = None,
) -> Maintenance:
    settings = core.settings
    outbox = settings.outbox_worker
    # one maintenance leader across processes: in Redis with Redis leases, else elected in the database
    lock: DatabaseMaintenanceLock | RedisMaintenanceLock
    if settings.lease.driver == "redis":
        lock = RedisMaintenanceLock.from_config(settings.redis, settings.lease)
        core.stack.push_async_callback(lock.aclose)
    else:
        lock = DatabaseMaintenanceLock(core.db)
    retention = RetentionSweeper(
        lock,
        [repository.delete_delivered, timer.purge_fired],
        retention_ms=ms(outbox.delivered_retention),
        batch_size=outbox.retention_batch_size,
        clock=core.clock,
    )
    dedup_retention = dedup_sweeper(lock, dedup_purges(core.db), settings, clock=core.clock)
    broker_retention = None
    if isinstance(broker, EmbeddedBroker):  # the other brokers keep their own retention
        broker_retention = RetentionSweeper(
            lock,
            [broker.purge],
            retention_ms=broker.retention_ms,
            batch_size=broker.cleanup_batch_size,
            clock=core.clock,
            lock_name=BROKER_RETENTION_LOCK,
        )
    return Maintenance(
        retention=retention,
        commands=commands,
        outbox_admin=outbox_admin,
        dedup_retention=dedup_retention,
        broker_retention=broker_retention,
    )
