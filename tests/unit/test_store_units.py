"""The store's save units on a Connection (store/sql.py): a save's coroutine, whose writes there never
wait, runs to its end at once inside the synchronous unit; one that waits is refused, not lost."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sqlalchemy as sa

from roomservice.store import sql

_t = sa.table("t", sa.column("k"), sa.column("v"))
INSERT = sa.insert(_t)
SET_V = sa.update(_t).where(_t.c.k == sa.bindparam("b_k")).values(v=sa.bindparam("b_v"))


def test_a_save_runs_to_its_end_on_a_connection_and_its_writes_take_effect() -> None:
    engine = sa.create_engine("sqlite://")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT)")

        async def save(writes: Any, given: sa.Connection, rows: list[dict[str, Any]]) -> tuple[int, int]:
            assert given is conn  # (for an attached write)
            await writes.insert_rows(INSERT, rows)
            return (
                await writes.execute_rendered(SET_V, {"b_k": 2, "b_v": "two"}),
                await writes.execute_rendered(SET_V, {"b_k": 9, "b_v": "none"}),
            )

        assert sql._on_connection(conn, save, [{"k": 1, "v": "a"}, {"k": 2, "v": "b"}]) == (1, 0)
        assert conn.exec_driver_sql("SELECT k, v FROM t ORDER BY k").all() == [(1, "a"), (2, "two")]


def test_a_save_that_waits_on_a_connection_is_refused() -> None:
    engine = sa.create_engine("sqlite://")
    with engine.connect() as conn:

        async def waits(_writes: Any, _conn: sa.Connection) -> None:
            await asyncio.sleep(0)  # nothing of a Connection's unit may wait: there is no loop to wait on

        with pytest.raises(RuntimeError, match="waits waited on a Connection's unit"):
            sql._on_connection(conn, waits)


def test_an_attached_write_needs_a_connections_unit() -> None:
    with pytest.raises(TypeError, match="Connection"):
        sql._attached_to(None)
