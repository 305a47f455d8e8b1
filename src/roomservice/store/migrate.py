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
from typing import Final, NamedTuple

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, text
from sqlalchemy.engine import URL, make_url

from roomservice.store.database import DEFAULT_TIMEOUT_S, Database

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


class Applied(NamedTuple):
    """One revision an upgrade applied: its id and the first line of its docstring."""

    revision: str
    message: str


class UpgradeReport(NamedTuple):
    """What :func:`upgrade` did: the revisions applied, oldest first, and where it ended."""

    applied: list[Applied]
    current: str | None


async def upgrade(db: Database, revision: str = "head") -> UpgradeReport:
    """Bring the schema up to ``revision``; a no-op when it is already there."""
    config = alembic_config()

    def run(connection: Connection) -> UpgradeReport:
        before = MigrationContext.configure(connection).get_current_revision()
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
        after = MigrationContext.configure(connection).get_current_revision()
        return UpgradeReport(_applied_between(before, after), after)

    async with db.write(bounded=False) as conn:  # DDL and the lock wait may take long
        if db.dialect_name == "mysql":
            got = await conn.scalar(
                text("SELECT GET_LOCK(:name, :timeout)"),
                {"name": _MYSQL_LOCK_NAME, "timeout": _MYSQL_LOCK_TIMEOUT_S},
            )
            if got != 1:
                raise TimeoutError("another process is migrating the schema; lock not obtained")
            try:
                return await conn.run_sync(run)
            finally:
                await conn.execute(text("SELECT RELEASE_LOCK(:name)"), {"name": _MYSQL_LOCK_NAME})
        return await conn.run_sync(run)


def _applied_between(before: str | None, after: str | None) -> list[Applied]:
    if after is None or after == before:
        return []
    scripts = ScriptDirectory.from_config(alembic_config())
    walked = scripts.iterate_revisions(after, before)  # newest first, ``before`` excluded
    return [Applied(script.revision, (script.doc or "").strip()) for script in reversed(list(walked))]


async def current_revision(db: Database) -> str | None:
    """The revision the database is at (None before the first migration)."""

    def read(connection: Connection) -> str | None:
        return MigrationContext.configure(connection).get_current_revision()

    async with db.read() as conn:
        return await conn.run_sync(read)


@asynccontextmanager
async def opened_database(
    url: str | URL,
    *,
    migrate: bool,
    pool_size: int = 20,
    max_overflow: int = 20,
    echo: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> AsyncIterator[Database]:
    """A :class:`Database` for the block, migrated to head first when ``migrate``; disposed after."""
    db = Database.from_url(url, pool_size=pool_size, max_overflow=max_overflow, echo=echo, timeout_s=timeout_s)
    try:
        if migrate:
            await upgrade(db)
        yield db
    finally:
        await db.dispose()


def upgrade_url(url: str | URL, revision: str = "head") -> UpgradeReport:
    """Synchronous entry point for ``room-service db upgrade``."""

    async def main() -> UpgradeReport:
        async with opened_database(url, migrate=False, pool_size=1, max_overflow=0) as db:
            return await upgrade(db, revision)

    return asyncio.run(main())


def sqlite_file(url: str | URL) -> Path | None:
    """The file of a SQLite database URL; None for other databases, ``:memory:`` and ``file:`` URIs.

    Read-only commands check it exists before opening: opening creates it (and its
    directory) empty."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return None
    database = parsed.database
    if not database or database == ":memory:" or database.startswith("file:") or parsed.query.get("mode") == "memory":
        return None
    return Path(database).expanduser().resolve()
