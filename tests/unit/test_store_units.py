"""Write units on a SQLite Connection (store/writes.py): a unit's coroutine, whose writes there never
wait, runs to its end at once inside the synchronous unit; one that waits is refused, not lost."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sqlalchemy as sa

from roomservice.store.writes import on_connection

_t = sa.table("t", sa.column("k"), sa.column("v"))
INSERT = sa.insert(_t)
SET_V = sa.update(_t).where(_t.c.k == sa.bindparam("b_k")).values(v=sa.bindparam("b_v"))
GET_V = sa.select(_t.c.v).where(_t.c.k == sa.bindparam("b_k"))


def test_a_unit_runs_to_its_end_on_a_connection_and_its_writes_take_effect() -> None:
    engine = sa.create_engine("sqlite://")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT)")

        async def unit(writes: Any, rows: list[dict[str, Any]]) -> tuple[int, int, Any]:
            assert writes.dialect.name == "sqlite"
            await writes.insert_rows(INSERT, rows)
            return (
                await writes.execute_rendered(SET_V, {"b_k": 2, "b_v": "two"}),
                await writes.execute_rendered(SET_V, {"b_k": 9, "b_v": "none"}),
                await writes.rows(GET_V, {"b_k": 2}),
            )

        assert on_connection(conn, unit, [{"k": 1, "v": "a"}, {"k": 2, "v": "b"}]) == (1, 0, [("two",)])
        assert conn.exec_driver_sql("SELECT k, v FROM t ORDER BY k").all() == [(1, "a"), (2, "two")]


def test_a_unit_that_waits_on_a_connection_is_refused() -> None:
    engine = sa.create_engine("sqlite://")
    with engine.connect() as conn:

        async def waits(_writes: Any) -> None:
            await asyncio.sleep(0)  # nothing of a Connection's unit may wait: there is no loop to wait on

        with pytest.raises(RuntimeError, match="waits waited on a Connection's unit"):
            on_connection(conn, waits)
