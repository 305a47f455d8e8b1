"""A bounded retention delete: the oldest rows of a table that match, by their primary key.

``OldestFirst(db, table, age, *where)`` is a :class:`~roomservice.outbox.retention.Purge`:
called with ``before_ms`` and ``limit``, it picks at most ``limit`` rows whose
``age`` column is below ``before_ms`` (and that match ``where``), oldest first,
and deletes exactly those by their primary key, in one write transaction. The
delete repeats the conditions, so a row that changed between the pick and the
delete (a timer rescheduled, a notice being sent again) stays. The same statements on
SQLite and MySQL/MariaDB: no ``DELETE … LIMIT`` (which SQLite lacks) and no
``DELETE … IN (SELECT … LIMIT)`` (which MariaDB refuses).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Connection, Table, and_, bindparam, delete, select

from roomservice.store.database import Database


class OldestFirst:
    def __init__(self, db: Database, table: Table, age: ColumnElement[Any], *where: ColumnElement[bool]) -> None:
        self.db = db
        self.table = table
        keys = list(table.primary_key.columns)
        self._names = [f"k_{c.name}" for c in keys]
        self._pick = (
            select(*keys).where(age < bindparam("b_before"), *where).order_by(age).limit(bindparam("b_limit"))
        )
        match = and_(*(c == bindparam(n) for c, n in zip(keys, self._names, strict=True)))
        self._drop = delete(table).where(match, age < bindparam("b_before"), *where)

    async def __call__(self, *, before_ms: int, limit: int) -> int:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        return await self.db.run_long_write(self._purge, {"b_before": before_ms, "b_limit": limit})

    def _purge(self, conn: Connection, params: dict[str, Any]) -> int:
        before = params["b_before"]
        rows = conn.execute(self._pick, params).all()
        keys = [{"b_before": before, **dict(zip(self._names, row, strict=True))} for row in rows]
        if not keys:
            return 0
        conn.execute(self._drop, keys)
        return len(keys)

    def __repr__(self) -> str:
        return f"OldestFirst({self.table.name})"
