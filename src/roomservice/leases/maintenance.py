"""The maintenance lock in the database: one process at a time runs a named maintenance job.

Used where no Redis is configured (several worker processes may share one
database without it): retention sweeps take it before each pass.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Final, Protocol

from sqlalchemy import text
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection

from roomservice.store.database import Database
from roomservice.store.port import StoreUnavailable

_GET_LOCK: Final = text("SELECT GET_LOCK(:name, 0)")
_RELEASE_LOCK: Final = text("SELECT RELEASE_LOCK(:name)")
_MYSQL_LOCK_NAME_MAX: Final = 64

# SQLite: process-local holders, by (database url, name)
_LOCAL_LOCKS: set[tuple[str, str]] = set()
_LOCAL_LOCKS_GUARD = threading.Lock()


class MaintenanceLock(Protocol):
    """A named, non-blocking, non-reentrant lock across processes."""

    async def try_acquire(self, name: str) -> bool:
        """Take ``name`` unless anyone (this object included) holds it."""
        ...

    async def release(self, name: str) -> None:
        """Give ``name`` back; harmless when not held."""
        ...


class DatabaseMaintenanceLock:
    def __init__(self, db: Database) -> None:
        self.db = db
        self._held: dict[str, AsyncConnection] = {}

    async def try_acquire(self, name: str) -> bool:
        """Take the named maintenance lock unless someone (this object included) holds it.

        MySQL/MariaDB: ``GET_LOCK`` (no wait) on a dedicated connection kept
        until :meth:`release`; the server drops the lock if
        that session dies, so a crashed process never blocks retention.
        The lock is server-wide, so its name includes the database name.

        SQLite: a process-local lock. Nothing stronger is needed: every delete
        batch is its own ``BEGIN IMMEDIATE`` transaction and SQLite runs one
        writer at a time, so two processes deleting at once only take turns
        on disjoint batches (a batch picks its ids inside its transaction);
        the worst case is wasted work, never a wrong delete.
        """
        if self.db.is_sqlite:
            key = (str(self.db.engine.url), name)
            with _LOCAL_LOCKS_GUARD:
                if key in _LOCAL_LOCKS:
                    return False
                _LOCAL_LOCKS.add(key)
            return True
        if name in self._held:
            return False
        try:
            conn = await self.db.engine.connect()
        except (OperationalError, InterfaceError) as exc:
            raise StoreUnavailable(f"database unavailable: {exc.__class__.__name__}") from exc
        try:
            # No transaction left open while the lock is held.
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            got = await conn.scalar(_GET_LOCK, {"name": self._server_lock_name(name)})
        except BaseException as exc:
            await conn.invalidate()
            await conn.close()
            if isinstance(exc, OperationalError | InterfaceError):
                raise StoreUnavailable(f"database unavailable: {exc.__class__.__name__}") from exc
            raise
        if got != 1:
            await conn.close()
            return False
        self._held[name] = conn
        return True

    async def release(self, name: str) -> None:
        """Give the lock back; a no-op unless this object holds it."""
        if self.db.is_sqlite:
            with _LOCAL_LOCKS_GUARD:
                _LOCAL_LOCKS.discard((str(self.db.engine.url), name))
            return
        conn = self._held.pop(name, None)
        if conn is None:
            return
        try:
            await conn.scalar(_RELEASE_LOCK, {"name": self._server_lock_name(name)})
        except (OperationalError, InterfaceError):
            # The session is gone or unusable; the server drops its locks with it.
            await conn.invalidate()
        finally:
            await conn.close()

    def _server_lock_name(self, name: str) -> str:
        full = f"roomservice:{self.db.engine.url.database}:{name}"
        if len(full) <= _MYSQL_LOCK_NAME_MAX:
            return full
        return "roomservice:" + hashlib.sha256(full.encode()).hexdigest()[:40]
