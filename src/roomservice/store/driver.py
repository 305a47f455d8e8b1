"""Statements run on the MySQL/MariaDB driver's own cursor, for the hottest write units (issue 12).

:meth:`Database.run_driver_write` runs an ``async`` unit ``fn(cursor, ...)`` inside the same
write block as :meth:`Database.run_write` (pooled connection, deadline, commit, rollback, a
lost or abandoned session invalidated and killed), but its statements go to the asyncmy
cursor directly instead of through SQLAlchemy's execution: no greenlet switch, execution
context or result processing per statement, rows as the driver's tuples. SQLAlchemy's
execution costs ~40-70 us of CPU a statement over the driver's own round trip (measured:
``SELECT %s`` 108-138 against 67 us) and the outbox worker runs three to six statements a
cycle, on the event loop its commands share.

Statements are still SQLAlchemy constructs: each is compiled once for the connection's
dialect (:class:`DriverSql`), the values bound in the construct itself taken from that
compilation and one expanding ``IN`` parameter spliced in per call. Only for statements whose
parameters and columns need no type processing (integers, strings, bytes).

SQLAlchemy's ``before_cursor_execute`` event is still announced for each statement (when
something listens). A driver error leaves as SQLAlchemy's own execution would raise it: the
:class:`~sqlalchemy.exc.DBAPIError` subclass of its kind, ``connection_invalidated`` (and the
connection invalidated, never pooled again) when the dialect calls it a disconnect.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError, StatementError
from sqlalchemy.ext.asyncio import AsyncConnection

_EXPANDING = "__[POSTCOMPILE_{}]"
T = TypeVar("T")


class DriverSql:
    """A statement compiled once for a dialect whose paramstyle is ``format`` (``%s``)."""

    __slots__ = ("_defaults", "_expanding", "_names", "_parts")

    def __init__(self, dialect: Dialect, statement: Any) -> None:
        if dialect.paramstyle != "format":
            raise ValueError(f"driver statements need the 'format' paramstyle, not {dialect.paramstyle!r}")
        compiled = statement.compile(dialect=dialect)
        names = tuple(compiled.positiontup or ())
        expanding = [name for name in names if _EXPANDING.format(name) in compiled.string]
        if len(expanding) > 1:
            raise ValueError("at most one expanding parameter")
        self._expanding = expanding[0] if expanding else None
        self._parts = (
            tuple(compiled.string.split(_EXPANDING.format(self._expanding)))
            if self._expanding
            else (compiled.string,)
        )
        self._names = names
        # values bound in the construct itself (a status literal, "+ 1", a None): given once, here
        self._defaults = {name: compiled.params[name] for name in names if not compiled.binds[name].required}

    @property
    def expands(self) -> bool:
        """Whether the SQL text depends on the parameters (an expanding ``IN``)."""
        return self._expanding is not None

    def render(self, params: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
        """The SQL text and its positional arguments for ``params``."""
        defaults = self._defaults
        if self._expanding is None:
            return self._parts[0], tuple(params[n] if n in params else defaults[n] for n in self._names)
        values = params[self._expanding]
        if not values:
            raise ValueError(f"{self._expanding}: an empty IN list")
        args: list[Any] = []
        for name in self._names:
            if name == self._expanding:
                args.extend(values)
            else:
                args.append(params[name] if name in params else defaults[name])
        return ", ".join(["%s"] * len(values)).join(self._parts), tuple(args)


class DriverCursor:
    """The driver cursor of one unit, statements by their SQLAlchemy construct."""

    __slots__ = ("_conn", "_cursor", "_sql")

    def __init__(self, conn: AsyncConnection, cursor: Any, sql: dict[int, DriverSql]) -> None:
        self._conn = conn
        self._cursor = cursor
        self._sql = sql

    def _rendered(self, statement: Any) -> DriverSql:
        sql = self._sql.get(id(statement))
        if sql is None:
            sql = self._sql[id(statement)] = DriverSql(self._conn.dialect, statement)
        return sql

    def _announce(self, text: str, args: Any, many: bool) -> None:
        """SQLAlchemy's ``before_cursor_execute`` event, for whoever listens (instrumentation, tests)."""
        sync = self._conn.sync_connection
        if sync is not None and sync.dispatch.before_cursor_execute:
            sync.dispatch.before_cursor_execute(sync, self._cursor, text, args, None, many)

    async def execute(self, statement: Any, params: dict[str, Any]) -> int:
        """Run ``statement``; the rows it matched (``CLIENT_FOUND_ROWS``) or returned."""
        text, args = self._rendered(statement).render(params)
        self._announce(text, args, False)
        return int(await self._call(text, args, lambda: self._cursor.execute(text, args)))

    async def rows(self, statement: Any, params: dict[str, Any]) -> Sequence[tuple[Any, ...]]:
        """Run the query ``statement``; its rows as the driver's tuples."""
        text, args = self._rendered(statement).render(params)
        self._announce(text, args, False)

        async def query() -> Sequence[tuple[Any, ...]]:
            await self._cursor.execute(text, args)
            rows: Sequence[tuple[Any, ...]] = await self._cursor.fetchall()
            return rows

        return await self._call(text, args, query)

    async def executemany(self, statement: Any, params: Sequence[dict[str, Any]]) -> int:
        """Run ``statement`` once per parameter set (one bulk call where the driver can); the rows matched."""
        sql = self._rendered(statement)
        if sql.expands:
            raise ValueError("executemany needs one SQL text: no expanding parameter")
        text = sql.render(params[0])[0]
        many = [sql.render(p)[1] for p in params]
        self._announce(text, many, True)
        await self._call(text, many, lambda: self._cursor.executemany(text, many))
        return int(self._cursor.rowcount)

    async def _call(self, text: str, args: Any, call: Callable[[], Awaitable[T]]) -> T:
        """``await call()``; a driver error raised as SQLAlchemy would raise it (:meth:`_translated`)."""
        try:
            return await call()
        except Exception as exc:
            translated = await self._translated(exc, text, args)
            if translated is None:
                raise
            raise translated from exc

    async def _translated(self, exc: Exception, text: str, args: Any) -> StatementError | None:
        """``exc`` as SQLAlchemy would raise it, a lost connection invalidated first; None when it is
        not the driver's."""
        dialect = self._conn.dialect
        dbapi = dialect.loaded_dbapi
        if isinstance(exc, AttributeError):  # asyncmy's way of saying its transport is gone (as SQLAlchemy reads it)
            exc = dbapi.InternalError("network operation failed due to asyncmy attribute error")
        if not isinstance(exc, dbapi.Error):
            return None
        lost = bool(dialect.is_disconnect(exc, None, None))
        if lost:
            await self._conn.invalidate(exc)
        return DBAPIError.instance(text, args, exc, dbapi.Error, connection_invalidated=lost, dialect=dialect)
