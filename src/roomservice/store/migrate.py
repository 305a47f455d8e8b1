"""Schema migrations, run programmatically: ``await upgrade(db)`` at start, ``upgrade_url`` for the CLI.

Alembic's configuration is built in code (no alembic.ini, nothing read from
the working directory); the scripts ship inside the package
(``roomservice/store/migrations``). The whole upgrade runs inside one
:meth:`Database.write` transaction, so on SQLite it holds the write lock
(``BEGIN IMMEDIATE``) and is transactional; on MySQL/MariaDB, where DDL commits
implicitly, concurrent upgrades from several processes are serialised by a
named server lock instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, text
from sqlalchemy.engine import URL

from roomservice.store.database import Database

MIGRATIONS_DIR: Final = Path(__file__).resolve().parent / "migrations"
_MYSQL_LOCK_NAME: Final = "roomservice.schema_migration"
_MYSQL_LOCK_TIMEOUT_S: Final = 120


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("path_separator", "os")
    return config


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


async def upgrade(db: Database, revision: str = "head") -> None:
    """Bring the schema up to ``revision``; a no-op when it is already there."""
    config = alembic_config()

    def run(connection: Connection) -> None:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)

    async with db.write() as conn:
        if db.dialect_name == "mysql":
            got = await conn.scalar(
                text("SELECT GET_LOCK(:name, :timeout)"),
                {"name": _MYSQL_LOCK_NAME, "timeout": _MYSQL_LOCK_TIMEOUT_S},
            )
            if got != 1:
                raise TimeoutError("another process is migrating the schema; lock not obtained")
            try:
                await conn.run_sync(run)
            finally:
                await conn.execute(text("SELECT RELEASE_LOCK(:name)"), {"name": _MYSQL_LOCK_NAME})
        else:
            await conn.run_sync(run)


async def current_revision(db: Database) -> str | None:
    """The revision the database is at (None before the first migration)."""

    def read(connection: Connection) -> str | None:
        return MigrationContext.configure(connection).get_current_revision()

    async with db.read() as conn:
        return await conn.run_sync(read)


@asynccontextmanager
async def opened_database(
    url: str | URL, *, migrate: bool, pool_size: int = 20, max_overflow: int = 20, echo: bool = False
) -> AsyncIterator[Database]:
    """A :class:`Database` for the block, migrated to head first when ``migrate``; disposed after."""
    db = Database.from_url(url, pool_size=pool_size, max_overflow=max_overflow, echo=echo)
    try:
        if migrate:
            await upgrade(db)
        yield db
    finally:
        await db.dispose()


def upgrade_url(url: str | URL, revision: str = "head") -> None:
    """Synchronous entry point for ``room-service db upgrade``."""

    async def main() -> None:
        async with opened_database(url, migrate=False, pool_size=1, max_overflow=0) as db:
            await upgrade(db, revision)

    asyncio.run(main())
