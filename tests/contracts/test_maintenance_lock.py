"""Contract of the maintenance lock in the database: one holder per name across processes, on both backends."""

from __future__ import annotations

from tests.contracts.test_outbox_repository import second_process

from roomservice.leases.maintenance import DatabaseMaintenanceLock
from roomservice.store.database import Database


async def test_maintenance_lock_excludes_a_second_holder_until_released(
    database: Database, backend_url: str
) -> None:
    async with second_process(backend_url) as other_db:
        repo = DatabaseMaintenanceLock(database)
        other = DatabaseMaintenanceLock(other_db)
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
