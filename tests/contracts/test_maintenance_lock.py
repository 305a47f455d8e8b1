"""Contract of the maintenance lock: one holder per name across processes.

Run against the database lock on both backends (no Redis: an election in the
database) and against the Redis lock (``lease.driver: redis``). Each adapter
gives two locks that behave like two processes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest_asyncio
import redis.asyncio as aioredis
from tests.conftest import RequireService
from tests.contracts.test_outbox_repository import second_process

from roomservice.leases.leader import RedisMaintenanceLock
from roomservice.leases.maintenance import DatabaseMaintenanceLock, MaintenanceLock
from roomservice.store.database import Database

Pair = tuple[MaintenanceLock, MaintenanceLock]


async def check_one_holder_per_name(repo: MaintenanceLock, other: MaintenanceLock) -> None:
    assert await repo.try_acquire("outbox-retention")
    try:
        assert not await other.try_acquire("outbox-retention")
        assert not await repo.try_acquire("outbox-retention")  # not re-entrant
        assert await other.try_acquire("another-job")  # names are independent
        await other.release("another-job")
    finally:
        await repo.release("outbox-retention")
    assert await other.try_acquire("outbox-retention")
    try:
        assert not await repo.try_acquire("outbox-retention")
    finally:
        await other.release("outbox-retention")
    await other.release("outbox-retention")  # releasing twice is harmless
    assert await repo.try_acquire("outbox-retention")
    await repo.release("outbox-retention")


async def test_database_maintenance_lock_excludes_a_second_holder_until_released(
    database: Database, backend_url: str
) -> None:
    async with second_process(backend_url) as other_db:
        await check_one_holder_per_name(DatabaseMaintenanceLock(database), DatabaseMaintenanceLock(other_db))


# --------------------------------------------------------------------------- Redis


@pytest_asyncio.fixture
async def redis_locks(require_service: RequireService) -> AsyncIterator[tuple[RedisMaintenanceLock, ...]]:
    """Two Redis locks ("processes") on the shared Redis, keys under a unique prefix; ttl 0.6s."""
    require_service("Redis", "127.0.0.1", 6379)
    client = aioredis.Redis(host="127.0.0.1", port=6379, decode_responses=True, socket_timeout=2.0)
    prefix = f"test-maintenance-{uuid.uuid4().hex[:12]}:"
    locks = tuple(
        RedisMaintenanceLock(
            client, ttl_s=0.6, renew_every_s=0.15, call_timeout_s=2.0, key_prefix=prefix, owner=f"proc-{n}"
        )
        for n in "ab"
    )
    try:
        yield locks
    finally:
        for lock in locks:
            await lock.aclose()
        keys = [key async for key in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def test_redis_maintenance_lock_excludes_a_second_holder_until_released(
    redis_locks: tuple[RedisMaintenanceLock, ...],
) -> None:
    repo, other = redis_locks
    await check_one_holder_per_name(repo, other)


async def test_redis_maintenance_lock_is_kept_past_its_ttl_while_held(
    redis_locks: tuple[RedisMaintenanceLock, ...],
) -> None:
    leader, other = redis_locks
    assert await leader.try_acquire("retention")
    await asyncio.sleep(3 * 0.6)  # the passage of time is the point: a long sweep, three ttls
    assert not await other.try_acquire("retention")
    assert leader.held("retention")
    await leader.release("retention")
    assert await other.try_acquire("retention")


async def test_a_crashed_redis_leader_frees_the_lock_within_its_ttl(
    redis_locks: tuple[RedisMaintenanceLock, ...],
) -> None:
    leader, other = redis_locks
    assert await leader.try_acquire("retention")
    for task in list(leader._renewals.values()):  # the process dies: nothing renews, nothing releases
        task.cancel()
    crashed_at = time.monotonic()
    while not await other.try_acquire("retention"):
        assert time.monotonic() - crashed_at < 0.6 + 1.0, "the lock outlived its ttl"
        await asyncio.sleep(0.01)
    await leader.release("retention")  # the old leader's late release spares the new one
    assert not await leader.try_acquire("retention")
    assert other.held("retention")


async def test_the_redis_lock_lives_under_the_configured_prefix(
    redis_locks: tuple[RedisMaintenanceLock, ...],
) -> None:
    leader, _ = redis_locks
    name = "roomservice_outbox_retention"
    assert await leader.try_acquire(name)
    assert await leader.client.exists(f"{leader.key_prefix}maintenance:{name}") == 1
    await leader.release(name)
    assert await leader.client.exists(f"{leader.key_prefix}maintenance:{name}") == 0
