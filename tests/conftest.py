"""Shared fixtures: the CI policy for external services, MariaDB and SQLite databases.

Policy: a test that needs a real service (MariaDB, Redis, NATS) skips when the
service does not answer on a developer machine, and FAILS when ``CI`` is
"true"/"1" — CI must never go green by skipping. Use the ``require_service``
fixture for that.

Databases:

* ``sqlite_url`` — a fresh SQLite file per test.
* ``mariadb_url`` — one migrated database per session, ``roomsvc_test_<hex>``;
  ``database`` empties its tables after every test.
* ``fresh_mariadb_url`` — a brand-new, empty (unmigrated) database per test.
* ``migrated_mariadb_url`` — a migrated database of this test alone, every table empty (auto-increment
  counters reset): taken from a session pool, truncated after the test and reused — a fresh database's
  migration costs ~2 s on MariaDB, a truncate ~70 ms.
* ``database`` — a migrated :class:`Database`, parametrized ``sqlite`` / ``mariadb``.

Set ``ROOMSERVICE_TEST_MARIADB_URL`` to point the tests at another server
(default ``mysql+asyncmy://root@127.0.0.1:3306/test``).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio
from sqlalchemy import text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import create_async_engine
from tests.nats_server import NATS_SERVER, OwnNatsServer

from roomservice.store.database import Database
from roomservice.store.migrate import upgrade
from roomservice.store.tables import metadata

MARIADB_SERVER_URL = os.environ.get("ROOMSERVICE_TEST_MARIADB_URL", "mysql+asyncmy://root@127.0.0.1:3306/test")
MARIADB_START_HINT = "start it: start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd"

T = TypeVar("T")
RequireService = Callable[..., None]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def _require_service(name: str, host: str, port: int, *, hint: str = "") -> None:
    """Skip (developer machine) or fail (CI) unless ``host:port`` accepts a TCP connection."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return
    except OSError as exc:
        reason = f"{name} not reachable at {host}:{port} ({exc.strerror or exc})"
        if hint:
            reason += f" ({hint})"
    if in_ci():
        pytest.fail(f"{reason}; CI requires it", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def require_service() -> RequireService:
    """``require_service(name, host, port, hint=...)``: the CI policy for a real service."""
    return _require_service


def run_in_fresh_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a new event loop in its own thread.

    Session-scoped setup must not touch a test's loop (async engines are bound
    to the loop they were created on), and may itself be requested from inside
    a running loop.
    """
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, name="test-admin-loop")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]  # type: ignore[no-any-return]


async def _admin(server_url: URL, *statements: str) -> None:
    engine = create_async_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            for statement in statements:
                await conn.execute(text(statement))
    finally:
        await engine.dispose()


def _create_mariadb_database(server_url: URL) -> tuple[str, str]:
    name = f"roomsvc_test_{secrets.token_hex(6)}"
    run_in_fresh_loop(_admin(server_url, f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    return name, server_url.set(database=name).render_as_string(hide_password=False)


def _drop_mariadb_database(server_url: URL, name: str) -> None:
    run_in_fresh_loop(_admin(server_url, f"DROP DATABASE IF EXISTS `{name}`"))


@pytest.fixture(scope="session")
def mariadb_server_url(require_service: RequireService) -> URL:
    url = make_url(MARIADB_SERVER_URL)
    require_service("MariaDB", url.host or "127.0.0.1", url.port or 3306, hint=MARIADB_START_HINT)
    return url


@pytest.fixture(scope="session")
def mariadb_url(mariadb_server_url: URL) -> Iterator[str]:
    """A migrated MariaDB database shared by the session (tests clean up their rows)."""
    name, url = _create_mariadb_database(mariadb_server_url)
    try:
        run_in_fresh_loop(_migrate(url))
        yield url
    finally:
        _drop_mariadb_database(mariadb_server_url, name)


@pytest.fixture
def fresh_mariadb_url(mariadb_server_url: URL) -> Iterator[str]:
    """An empty MariaDB database of this test alone, dropped afterwards."""
    name, url = _create_mariadb_database(mariadb_server_url)
    try:
        yield url
    finally:
        _drop_mariadb_database(mariadb_server_url, name)


async def _migrate(url: str) -> None:
    db = Database.from_url(url, pool_size=1, max_overflow=0)
    try:
        await upgrade(db)
    finally:
        await db.dispose()


async def _truncate_every_table(server_url: URL, name: str) -> None:
    """Every table of database ``name`` but alembic's emptied, auto-increment counters back at 1."""
    engine = create_async_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            tables = await conn.scalars(
                text(
                    "SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = :schema"
                    " AND TABLE_TYPE = 'BASE TABLE' AND TABLE_NAME <> 'alembic_version'"
                ),
                {"schema": name},
            )
            await conn.execute(text("SET SESSION foreign_key_checks = 0, lock_wait_timeout = 10"))
            for table in list(tables):
                await conn.execute(text(f"TRUNCATE TABLE `{name}`.`{table}`"))
    finally:
        await engine.dispose()


class MigratedMariadbPool:
    """Migrated MariaDB databases handed out one test at a time, emptied in between; dropped at the end."""

    def __init__(self, server_url: URL) -> None:
        self.server_url = server_url
        self.free: list[tuple[str, str]] = []
        self.made: list[str] = []

    def take(self) -> tuple[str, str]:
        if self.free:
            return self.free.pop()
        name, url = _create_mariadb_database(self.server_url)
        self.made.append(name)
        run_in_fresh_loop(_migrate(url))
        return name, url

    def give_back(self, name: str, url: str) -> None:
        try:
            run_in_fresh_loop(_truncate_every_table(self.server_url, name))
        except Exception:  # not reusable (e.g. a lock left behind): the next test gets a new one
            return
        self.free.append((name, url))

    def drop_all(self) -> None:
        for name in self.made:
            _drop_mariadb_database(self.server_url, name)


@pytest.fixture(scope="session")
def migrated_mariadb_pool(mariadb_server_url: URL) -> Iterator[MigratedMariadbPool]:
    pool = MigratedMariadbPool(mariadb_server_url)
    try:
        yield pool
    finally:
        pool.drop_all()


@pytest.fixture
def migrated_mariadb_url(migrated_mariadb_pool: MigratedMariadbPool) -> Iterator[str]:
    """A migrated MariaDB database of this test alone, every table empty; emptied again afterwards."""
    name, url = migrated_mariadb_pool.take()
    try:
        yield url
    finally:
        migrated_mariadb_pool.give_back(name, url)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path}/room.db"


@pytest.fixture(params=["sqlite", "mariadb"])
def backend_url(request: pytest.FixtureRequest) -> str:
    """The URL of a migrated database on each backend (MariaDB: the shared session database)."""
    fixture = "sqlite_url" if request.param == "sqlite" else "mariadb_url"
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.fixture(params=["sqlite", "mariadb"])
def empty_backend_url(request: pytest.FixtureRequest) -> str:
    """The URL of an empty, never migrated database on each backend."""
    fixture = "sqlite_url" if request.param == "sqlite" else "fresh_mariadb_url"
    url: str = request.getfixturevalue(fixture)
    return url


@asynccontextmanager
async def migrated_database(url: str) -> AsyncIterator[Database]:
    """A migrated :class:`Database` on ``url``; on MariaDB every table is emptied afterwards."""
    db = Database.from_url(url, pool_size=5, max_overflow=5)
    await upgrade(db)
    try:
        yield db
    finally:
        if db.dialect_name == "mysql":
            async with db.write() as conn:
                for table in reversed(metadata.sorted_tables):
                    await conn.execute(table.delete())
        await db.dispose()


@pytest_asyncio.fixture
async def database(backend_url: str) -> AsyncIterator[Database]:
    """A migrated :class:`Database` on each backend (parametrized sqlite / mariadb)."""
    async with migrated_database(backend_url) as db:
        yield db


@pytest_asyncio.fixture
async def mariadb_database(mariadb_url: str) -> AsyncIterator[Database]:
    """A migrated MariaDB :class:`Database`, for tests of MariaDB-only behaviour."""
    async with migrated_database(mariadb_url) as db:
        yield db


@pytest_asyncio.fixture
async def sqlite_database(sqlite_url: str) -> AsyncIterator[Database]:
    """A migrated SQLite :class:`Database`, for tests of SQLite-only behaviour."""
    async with migrated_database(sqlite_url) as db:
        yield db


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[OwnNatsServer]:
    """A ``nats-server -js`` of this test alone (free port, temporary store), started; killed afterwards."""
    if not os.path.exists(NATS_SERVER):
        pytest.fail(f"{NATS_SERVER} is needed for the broker-restart tests", pytrace=False)
    server = OwnNatsServer(tmp_path / "jetstream")
    server.start()
    yield server
    server.kill()


class Calls:
    """How often a wrapped coroutine function was called (:func:`count_calls`)."""

    def __init__(self) -> None:
        self.count = 0


def count_calls(monkeypatch: pytest.MonkeyPatch, target: object, name: str) -> Calls:
    """Count the calls of the coroutine method ``target.name`` (e.g. a Database's run_write) from now on."""
    original = getattr(target, name)
    calls = Calls()

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls.count += 1
        return await original(*args, **kwargs)

    monkeypatch.setattr(target, name, counted)
    return calls
