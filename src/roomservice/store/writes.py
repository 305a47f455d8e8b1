"""Units written once for both backends, their statements on the driver's cursor (issue 12).

A unit of a command's path (the store's save, the embedded wallet's debit attached to it, the debit
journal; a room's load and a command's look-up, which only read) is a coroutine ``fn(writes, *args)``
over :class:`~roomservice.store.port.Writes`:

* MySQL/MariaDB: an async unit of :meth:`Database.run_driver_write`, ``writes`` its
  :class:`~roomservice.store.driver.DriverCursor` on a held session: no checkout, BEGIN, greenlet
  hop or execution context a statement, COMMIT or check-in through SQLAlchemy's asyncio connection
  (bench.command_path at concurrency 1 on MariaDB: 823 -> 536-558 us of CPU a join).
* SQLite: a Connection's unit of :meth:`Database.run_write` (inline on the loop's thread, or on a
  thread), ``writes`` the sqlite3 cursor of its transaction
  (:class:`~roomservice.store.driver.SqliteCursor`). Nothing there waits: the coroutine is run to
  its end at once inside the synchronous unit (:func:`on_connection` refuses one that waits).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection

from roomservice.store.database import Database
from roomservice.store.driver import SqliteCursor

T = TypeVar("T")


async def run_writes(db: Database, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
    """``fn(writes, *args)`` in one write transaction of ``db``, committed unless it raises."""
    if db.is_sqlite:
        return await db.run_write(on_connection, fn, *args)
    return await db.run_driver_write(fn, *args)


async def run_reads(db: Database, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
    """``fn(reads, *args)`` for a unit that only reads (a room's load, a command's look-up), on the same
    cursors: on SQLite a read unit of :meth:`Database.run_read` (inline, one snapshot), on MySQL/MariaDB
    a driver unit as :func:`run_writes` runs one (its transaction, which wrote nothing, committed)."""
    if db.is_sqlite:
        return await db.run_read(on_connection, fn, *args)
    return await db.run_driver_write(fn, *args)


class _SqliteWrites:
    """:class:`~roomservice.store.port.Writes` of a SQLite unit: its transaction's sqlite3 cursor,
    where nothing waits."""

    __slots__ = ("_cursor", "dialect")

    def __init__(self, conn: Connection) -> None:
        self.dialect = conn.dialect
        self._cursor = SqliteCursor(conn)

    async def execute_rendered(self, statement: Any, params: dict[str, Any]) -> int:
        return self._cursor.execute_rendered(statement, params)

    async def insert_rows(self, insert: Any, rows: Sequence[dict[str, Any]]) -> None:
        self._cursor.insert_rows(insert, rows)

    async def rows(self, statement: Any, params: dict[str, Any]) -> Sequence[tuple[Any, ...]]:
        return self._cursor.rows(statement, params)


def on_connection(conn: Connection, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
    """``fn(writes, *args)`` as a SQLite Connection's unit: the coroutine, whose writes there never
    wait, run to its end at once."""
    unit = fn(_SqliteWrites(conn), *args)
    try:
        unit.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    unit.close()
    raise RuntimeError(f"{fn.__name__} waited on a Connection's unit")
