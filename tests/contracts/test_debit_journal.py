"""The debit journal (wallet/journal.py) on SQLite and MariaDB: a gift journals its debit key before it
asks an external wallet; a retry restarts the entry's clock; a refused debit forgets it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from tests.conftest import migrated_database

from roomservice.store.database import Database
from roomservice.wallet.journal import DebitJournal, JournalEntry


@pytest_asyncio.fixture(params=["sqlite", "mariadb"])
async def db(request: pytest.FixtureRequest) -> AsyncIterator[Database]:
    url: str = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "mariadb_url")
    async with migrated_database(url) as database:
        yield database


def entry(key: str, at_ms: int) -> JournalEntry:
    return JournalEntry(key, "app", "room", f"cmd-{key}", "bob", 10, at_ms)


async def test_a_retried_entry_restarts_its_clock_and_a_forgotten_one_is_gone(db: Database) -> None:
    journal = DebitJournal(db)
    await journal.record(entry("k1", 1_000))
    await journal.record(entry("k2", 2_000))
    assert [e.debit_key for e in await journal.older_than(5_000, limit=10)] == ["k1", "k2"]

    await journal.record(entry("k1", 3_000))  # the same command tried again: one entry, its clock restarted
    assert await journal.older_than(5_000, limit=10) == [entry("k2", 2_000), entry("k1", 3_000)]
    assert await journal.older_than(2_500, limit=10) == [entry("k2", 2_000)]

    await journal.forget("k2")
    await journal.forget("k2")  # (forgetting twice is harmless)
    assert await journal.older_than(5_000, limit=10) == [entry("k1", 3_000)]
