"""Statements on the driver's own cursor (store/driver.py): ``Database.run_driver_write`` on the real
MariaDB, with the transaction discipline, errors and lost connections of ``run_write``; and a SQLite
unit's :class:`SqliteCursor`, inline and on a thread."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import sqlalchemy as sa
from asyncmy import errors as asyncmy_errors
from sqlalchemy.dialects import sqlite
from sqlalchemy.dialects.mysql import asyncmy
from sqlalchemy.exc import IntegrityError
from tests.integration.test_database_deadlines import SLACK, D, eventually, session_id, through
from tests.tcp_proxy import TcpProxy

from roomservice.store import database as database_module
from roomservice.store.database import Database
from roomservice.store.driver import DriverCursor, DriverSql, SqliteCursor
from roomservice.store.port import StoreDeadlineExceeded, StoreUnavailable

_t = sa.table("driver_rows", sa.column("id"), sa.column("n"), sa.column("tag"))
SET_N = sa.update(_t).where(_t.c.id.in_(sa.bindparam("ids", expanding=True))).values(n=sa.bindparam("n"), tag="set")
BUMP = sa.update(_t).where(_t.c.id == sa.bindparam("id")).values(n=_t.c.n + 1)
INSERT = sa.insert(_t).values(id=sa.bindparam("id"), n=sa.bindparam("n"), tag="new")
ROWS = sa.select(_t.c.id, _t.c.n, _t.c.tag).where(_t.c.id >= sa.bindparam("from_id")).order_by(_t.c.id)
SESSION = sa.text("SELECT CONNECTION_ID()")


# --------------------------------------------------------------------------- rendering (no database)


def test_a_statement_renders_its_own_values_and_splices_the_expanding_list() -> None:
    sql = DriverSql(asyncmy.dialect(), SET_N)
    text, args = sql.render({"ids": [3, 4, 5], "n": 7})
    assert text.endswith("WHERE driver_rows.id IN (%s, %s, %s)")
    assert args == (7, "set", 3, 4, 5)  # "set": bound in the construct itself
    assert sql.render({"ids": [9], "n": 1}) == (text.replace("(%s, %s, %s)", "(%s)"), (1, "set", 9))
    with pytest.raises(ValueError, match="empty IN"):
        sql.render({"ids": [], "n": 1})
    with pytest.raises(KeyError):
        sql.render({"ids": [1]})  # a missing parameter is never sent as NULL


def test_a_none_bound_in_the_construct_is_sent_as_none() -> None:
    clear = sa.update(_t).where(_t.c.id == sa.bindparam("id")).values(tag=None)
    text, args = DriverSql(asyncmy.dialect(), clear).render({"id": 4})
    assert text.startswith("UPDATE driver_rows SET tag=%s") and args == (None, 4)


def test_a_statement_renders_with_sqlites_placeholders() -> None:
    text, args = DriverSql(sa.create_engine("sqlite://").dialect, SET_N).render({"ids": [3, 4], "n": 7})
    assert text.endswith("WHERE driver_rows.id IN (?, ?)") and "%s" not in text
    assert args == (7, "set", 3, 4)


def test_a_statement_needs_a_positional_paramstyle() -> None:
    with pytest.raises(ValueError, match="paramstyle"):
        DriverSql(sqlite.dialect(paramstyle="named"), SET_N)


# --------------------------------------------------------------------------- on MariaDB


@pytest_asyncio.fixture
async def db(mariadb_url: str) -> AsyncIterator[Database]:
    database = Database.from_url(mariadb_url, pool_size=1, max_overflow=0, timeout_s=5.0)
    async with database.write() as conn:
        await conn.execute(sa.text("CREATE TABLE IF NOT EXISTS driver_rows (id INT PRIMARY KEY, n INT, tag TEXT)"))
        await conn.execute(sa.text("DELETE FROM driver_rows"))
        await conn.execute(sa.text("INSERT INTO driver_rows VALUES (1, 0, 'a'), (2, 0, 'b'), (3, 0, 'c')"))
    try:
        yield database
    finally:
        async with database.write() as conn:
            await conn.execute(sa.text("DROP TABLE IF EXISTS driver_rows"))
        await database.dispose()


async def rows(db: Database) -> list[tuple[Any, ...]]:
    async with db.read() as conn:
        return [tuple(r) for r in await conn.execute(sa.text("SELECT id, n, tag FROM driver_rows ORDER BY id"))]


async def test_a_unit_commits_its_statements_together_and_counts_matched_rows(db: Database) -> None:
    async def unit(cur: DriverCursor) -> tuple[int, int, Any]:
        changed = await cur.execute(SET_N, {"ids": [1, 2, 99], "n": 5})
        bumped = await cur.executemany(BUMP, [{"id": 1}, {"id": 3}, {"id": 98}])
        return changed, bumped, await cur.rows(ROWS, {"from_id": 2})

    changed, bumped, seen = await db.run_driver_write(unit)
    assert (changed, bumped) == (2, 2)  # rows matched; the missing ids count nothing
    assert list(seen) == [(2, 5, "set"), (3, 1, "c")]  # the driver's tuples, inside the transaction
    assert await rows(db) == [(1, 6, "set"), (2, 5, "set"), (3, 1, "c")]


async def test_a_unit_that_raises_leaves_nothing_behind(db: Database) -> None:
    async def unit(cur: DriverCursor) -> None:
        await cur.execute(SET_N, {"ids": [1], "n": 9})
        raise RuntimeError("the unit changed its mind")

    with pytest.raises(RuntimeError):
        await db.run_driver_write(unit)
    assert await rows(db) == [(1, 0, "a"), (2, 0, "b"), (3, 0, "c")]


async def test_a_server_error_is_sqlalchemys_and_the_connection_stays_pooled(db: Database) -> None:
    before = await session_id(db)

    async def unit(cur: DriverCursor) -> None:
        await cur.execute(SET_N, {"ids": [1], "n": 9})
        await cur.execute(INSERT, {"id": 2, "n": 1})  # duplicate key

    with pytest.raises(IntegrityError) as failure:
        await db.run_driver_write(unit)
    assert failure.value.orig is not None and failure.value.orig.args[0] == 1062  # the server's code kept
    assert not failure.value.connection_invalidated
    assert await rows(db) == [(1, 0, "a"), (2, 0, "b"), (3, 0, "c")]  # rolled back whole
    assert await session_id(db) == before  # the same session, pooled again


async def test_a_session_killed_mid_unit_is_unavailable_and_never_pooled_again(db: Database, mariadb_url: str) -> None:
    killer = Database.from_url(mariadb_url, pool_size=1, max_overflow=0, timeout_s=5.0)

    async def unit(cur: DriverCursor) -> None:
        await cur.execute(SET_N, {"ids": [1], "n": 9})
        (session,) = (await cur.rows(SESSION, {}))[0]
        async with killer.write() as conn:
            await conn.execute(sa.text(f"KILL CONNECTION {int(session)}"))
        await cur.execute(SET_N, {"ids": [2], "n": 9})  # on a connection the server closed

    try:
        with pytest.raises(StoreUnavailable) as failure:
            await db.run_driver_write(unit)
        lost = failure.value.__cause__
        assert isinstance(lost, sa.exc.DBAPIError)
        # the statement's own failure, the connection invalidated at once (no rollback tried on it)
        assert lost.statement is not None and lost.statement.startswith("UPDATE driver_rows")
        assert lost.connection_invalidated
        assert db.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        assert await rows(db) == [(1, 0, "a"), (2, 0, "b"), (3, 0, "c")]  # a fresh session answers
    finally:
        await killer.dispose()


def _announcements(engine: sa.Engine) -> tuple[list[tuple[Any, ...]], Any]:
    """What SQLAlchemy's listeners of ``engine`` hear, in order: ("before" | "after", statement,
    parameters, executemany), ("commit",), ("rollback",); and a function that stops listening."""
    heard: list[tuple[Any, ...]] = []

    def before(_conn: Any, _cursor: Any, statement: str, params: Any, _context: Any, many: bool) -> None:
        heard.append(("before", statement, params, many))

    def after(_conn: Any, _cursor: Any, statement: str, params: Any, _context: Any, many: bool) -> None:
        heard.append(("after", statement, params, many))

    listeners = [
        ("before_cursor_execute", before),
        ("after_cursor_execute", after),
        ("commit", lambda _conn: heard.append(("commit",))),
        ("rollback", lambda _conn: heard.append(("rollback",))),
    ]
    for name, fn in listeners:
        sa.event.listen(engine, name, fn)

    def stop() -> None:
        for name, fn in listeners:
            sa.event.remove(engine, name, fn)

    return heard, stop


async def test_statements_are_announced_to_sqlalchemys_listeners(db: Database) -> None:
    heard, stop = _announcements(db.engine.sync_engine)
    try:
        await db.run_driver_write(lambda cur: cur.execute(SET_N, {"ids": [1, 2], "n": 3}))
    finally:
        stop()
    set_n = "UPDATE driver_rows SET n=%s, tag=%s"
    assert [(h[0], h[1].split(" WHERE")[0], *h[2:]) if len(h) > 1 else h for h in heard] == [
        ("before", set_n, (3, "set", 1, 2), False),
        ("after", set_n, (3, "set", 1, 2), False),  # once it ran: a listener may act on it (cut the link)
        ("commit",),
    ]


async def test_a_failed_statement_is_not_announced_done_and_its_unit_announces_its_rollback(db: Database) -> None:
    heard, stop = _announcements(db.engine.sync_engine)
    try:
        with pytest.raises(IntegrityError):
            await db.run_driver_write(lambda cur: cur.execute(INSERT, {"id": 2, "n": 1}))  # duplicate key
    finally:
        stop()
    assert [h[0] for h in heard] == ["before", "rollback"]


RENDERED_INSERT = sa.insert(_t)
RENDERED_BUMP = sa.update(_t).where(_t.c.id == sa.bindparam("b_id")).values(n=_t.c.n + sa.bindparam("b_by"))


async def test_rendered_statements_insert_rows_and_count_matched_rows(db: Database) -> None:
    async def unit(cur: DriverCursor) -> tuple[int, int]:
        await cur.insert_rows(RENDERED_INSERT, [{"id": 7, "n": 1, "tag": "one"}])  # one row: a plain execute
        await cur.insert_rows(RENDERED_INSERT, [{"id": 8, "n": 2, "tag": "x"}, {"id": 9, "n": 3, "tag": "y"}])
        return (
            await cur.execute_rendered(RENDERED_BUMP, {"b_id": 8, "b_by": 10}),
            await cur.execute_rendered(RENDERED_BUMP, {"b_id": 99, "b_by": 10}),
        )

    assert await db.run_driver_write(unit) == (1, 0)
    assert (await rows(db))[3:] == [(7, 1, "one"), (8, 12, "x"), (9, 3, "y")]

    async def duplicate(cur: DriverCursor) -> None:
        await cur.insert_rows(RENDERED_INSERT, [{"id": 10, "n": 0, "tag": "new"}, {"id": 7, "n": 0, "tag": "dup"}])

    with pytest.raises(IntegrityError):  # SQLAlchemy's, as for every driver statement
        await db.run_driver_write(duplicate)
    assert len(await rows(db)) == 6  # neither row of the failed bulk insert stayed


async def test_sqlite_units_are_refused(tmp_path: Any) -> None:
    database = Database.from_url(f"sqlite+aiosqlite:///{tmp_path}/x.db")
    try:
        with pytest.raises(TypeError, match="MySQL"):
            await database.run_driver_write(lambda cur: cur.execute(SET_N, {"ids": [1], "n": 1}))
    finally:
        await database.dispose()


async def test_executemany_refuses_a_statement_whose_text_varies(db: Database) -> None:
    with pytest.raises(ValueError, match="expanding"):
        await db.run_driver_write(lambda cur: cur.executemany(SET_N, [{"ids": [1], "n": 1}, {"ids": [2, 3], "n": 2}]))
    assert await rows(db) == [(1, 0, "a"), (2, 0, "b"), (3, 0, "c")]


class BrokenCursor:
    """A cursor whose execute fails with an error of its own (not the driver's)."""

    async def execute(self, text: str, args: Any) -> int:
        raise RuntimeError("not a database error")


async def test_an_error_that_is_not_the_drivers_leaves_as_it_is(db: Database) -> None:
    async with db.write() as conn:
        cursor = DriverCursor(conn, BrokenCursor())
        with pytest.raises(RuntimeError, match="not a database error") as failure:
            await cursor.execute(SET_N, {"ids": [1], "n": 1})
    assert failure.value.__cause__ is None  # re-raised as it is: not wrapped, not chained to itself
    assert not conn.invalidated


# --------------------------------------------------------------------------- sessions held between units


async def held_session(db: Database) -> int:
    """The server's id of the session a driver unit runs on."""
    return int((await db.run_driver_write(lambda cur: cur.rows(SESSION, {})))[0][0])


async def concurrent_sessions(db: Database, n: int) -> set[int]:
    """The sessions of ``n`` driver units in flight at once."""
    everyone_in = asyncio.Barrier(n)

    async def unit(cur: DriverCursor) -> int:
        (session,) = (await cur.rows(SESSION, {}))[0]
        await everyone_in.wait()
        return int(session)

    return set(await asyncio.gather(*(db.run_driver_write(unit) for _ in range(n))))


@pytest_asyncio.fixture
async def holding(db: Database, mariadb_url: str) -> AsyncIterator[Database]:
    """The ``driver_rows`` table of ``db``, through a database whose pool of 8 holds two sessions idle."""
    database = Database.from_url(mariadb_url, pool_size=8, max_overflow=0, timeout_s=5.0)
    try:
        yield database
    finally:
        await database.dispose()


def checked_out(db: Database) -> int:
    return int(db.engine.pool.checkedout())  # type: ignore[attr-defined]


async def test_units_one_after_another_run_on_one_held_session_beside_the_pool(holding: Database) -> None:
    first = await held_session(holding)
    assert await held_session(holding) == first
    assert checked_out(holding) == 1  # held between units
    assert await session_id(holding) != first  # a block takes a pooled connection of its own
    await holding.run_driver_write(lambda cur: cur.execute(SET_N, {"ids": [1], "n": 4}))
    assert await rows(holding) == [(1, 4, "set"), (2, 0, "b"), (3, 0, "c")]  # committed: seen from the pool
    assert await held_session(holding) == first


async def test_at_most_a_quarter_of_the_pool_is_held_idle(holding: Database) -> None:
    sessions = await concurrent_sessions(holding, 4)
    assert len(sessions) == 4
    assert checked_out(holding) == 2  # 8 // 4 kept; the others went back to the pool
    assert await concurrent_sessions(holding, 2) <= sessions


async def test_a_unit_the_server_refuses_rolls_back_and_its_session_serves_the_next(holding: Database) -> None:
    before = await held_session(holding)

    async def unit(cur: DriverCursor) -> None:
        await cur.execute(SET_N, {"ids": [1], "n": 9})
        await cur.execute(INSERT, {"id": 2, "n": 1})  # duplicate key

    with pytest.raises(IntegrityError):
        await holding.run_driver_write(unit)
    assert await rows(holding) == [(1, 0, "a"), (2, 0, "b"), (3, 0, "c")]  # rolled back whole
    assert await held_session(holding) == before
    # and nothing of the failed unit is left open on it: a lock it took is free for another session
    async with holding.write() as conn:
        await conn.execute(sa.text("UPDATE driver_rows SET n = 2 WHERE id = 1"))
    assert await rows(holding) == [(1, 2, "a"), (2, 0, "b"), (3, 0, "c")]


async def test_a_lost_session_lets_every_idle_one_go(holding: Database, mariadb_url: str) -> None:
    idle = await concurrent_sessions(holding, 2)
    killer = Database.from_url(mariadb_url, pool_size=1, max_overflow=0, timeout_s=5.0)

    async def unit(cur: DriverCursor) -> None:
        (session,) = (await cur.rows(SESSION, {}))[0]
        async with killer.write() as conn:
            await conn.execute(sa.text(f"KILL CONNECTION {int(session)}"))
        await cur.execute(SET_N, {"ids": [2], "n": 9})  # on a connection the server closed

    try:
        with pytest.raises(StoreUnavailable):
            await holding.run_driver_write(unit)
        fresh = await concurrent_sessions(holding, 2)
        assert not fresh & idle  # the sessions held before the loss were let go, not used again
        assert checked_out(holding) == 2

        async def gone() -> None:
            async with killer.read() as conn:
                alive = (
                    await conn.execute(
                        sa.text("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID IN :ids").bindparams(
                            sa.bindparam("ids", expanding=True)
                        ),
                        {"ids": sorted(idle)},
                    )
                ).scalar_one()
            assert alive == 0, f"{alive} of the let-go sessions still on the server"

        await eventually(gone, within_s=5, what="the let-go sessions closed on the server")
    finally:
        await killer.dispose()


async def test_a_loss_seen_by_a_driver_unit_retires_the_pooled_connections_too(
    holding: Database, mariadb_url: str
) -> None:
    # A server that went away (a restart, a failover) took every session with it, the pool's idle ones too.
    # SQLAlchemy's own execution, on the first lost connection it sees, has the pool retire every connection
    # older than that (they are replaced at their next checkout); a driver unit must do the same, or each
    # stale pooled connection fails one more command (issue 12 review).
    sessions = await concurrent_sessions(holding, 6)  # 2 held idle afterwards, 4 back in the pool
    assert len(sessions) == 6 and checked_out(holding) == 2
    killer = Database.from_url(mariadb_url, pool_size=1, max_overflow=0, timeout_s=5.0)
    try:
        async with killer.write() as conn:
            for session in sessions:
                await conn.execute(sa.text(f"KILL CONNECTION {session}"))
    finally:
        await killer.dispose()

    failed = 0
    for _ in range(8):
        try:
            await holding.run_driver_write(lambda cur: cur.execute(SET_N, {"ids": [1], "n": 7}))
        except StoreUnavailable:
            failed += 1
        else:
            break
    assert failed == 1  # the unit that met the loss; the next one ran on a fresh connection
    assert await rows(holding) == [(1, 7, "set"), (2, 0, "b"), (3, 0, "c")]
    assert not await concurrent_sessions(holding, 6) & sessions  # nothing of the old server's used again


async def test_a_unit_cancelled_while_stale_sessions_are_let_go_still_hands_its_own_back(
    holding: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    await concurrent_sessions(holding, 2)  # two held idle
    assert checked_out(holding) == 2
    held = holding._held
    release = held._release
    releasing = asyncio.Event()
    go_on = asyncio.Event()

    async def slow_release(session: Any) -> None:  # letting a stale session go takes a while
        releasing.set()
        await go_on.wait()
        await release(session)

    monkeypatch.setattr(held, "_release", slow_release)
    in_unit = asyncio.Event()
    leave = asyncio.Event()

    async def unit(cur: DriverCursor) -> None:
        await cur.rows(SESSION, {})
        in_unit.set()
        await leave.wait()

    task = asyncio.create_task(holding.run_driver_write(unit))
    await in_unit.wait()
    held.lost()  # a loss elsewhere meanwhile: the idle session left is stale, and so is the unit's
    leave.set()
    await releasing.wait()  # the unit ended; its runner lets the stale idle one go first
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        task.cancel()  # the caller gives up then
        with pytest.raises(asyncio.CancelledError):
            await task
        del task
        gc.collect()
        go_on.set()

        async def all_back() -> None:
            assert checked_out(holding) == 0

        await eventually(all_back, within_s=5, what="every session back in the pool")
    # the unit's own session was let go, not left to the garbage collector (which would say so)
    assert not [w for w in warned if "non-checked-in connection" in str(w.message)]


async def test_a_held_session_goes_back_to_the_pool_with_its_read_timeout_after_its_time(
    holding: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    drivers: list[Any] = []

    async def unit(cur: DriverCursor) -> int:
        drivers.append(cur._cursor.connection)
        assert cur._cursor.connection._read_timeout is None  # bounded by the unit's deadline instead
        (session,) = (await cur.rows(SESSION, {}))[0]
        return int(session)

    first = await holding.run_driver_write(unit)
    assert checked_out(holding) == 1
    monkeypatch.setattr(database_module, "_HELD_FOR_S", 0.0)
    # the held session is let go to the pool, the unit takes one from there (the same: the pool's only
    # connection) and lets it go again at its end
    assert await holding.run_driver_write(unit) == first
    assert checked_out(holding) == 0
    assert drivers[-1] is drivers[0] and drivers[0]._read_timeout == 2 * holding.timeout_s  # the backstop, back on
    assert await session_id(holding) == first  # pooled for blocks again


async def test_dispose_hands_the_held_sessions_back(holding: Database) -> None:
    sessions = await concurrent_sessions(holding, 2)
    pool = holding.engine.pool  # dispose() puts a fresh pool in its place: count on this one
    assert len(sessions) == 2 and pool.checkedout() == 2  # type: ignore[attr-defined]
    await holding.dispose()
    assert pool.checkedout() == 0  # type: ignore[attr-defined]


async def alive(db: Database, sessions: set[int]) -> int:
    """How many of ``sessions`` the server still has."""
    async with db.read() as conn:
        query = sa.text("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID IN :ids").bindparams(
            sa.bindparam("ids", expanding=True)
        )
        return int((await conn.execute(query, {"ids": sorted(sessions)})).scalar_one())


async def test_a_unit_raising_its_own_error_rolls_back_and_keeps_its_session(holding: Database) -> None:
    before = await held_session(holding)

    async def unit(cur: DriverCursor) -> None:
        await cur.execute(SET_N, {"ids": [1], "n": 9})
        raise RuntimeError("the unit changed its mind")

    with pytest.raises(RuntimeError):
        await holding.run_driver_write(unit)
    assert await rows(holding) == [(1, 0, "a"), (2, 0, "b"), (3, 0, "c")]
    assert await held_session(holding) == before


async def test_a_caller_that_goes_away_mid_unit_has_its_held_session_discarded_and_killed(holding: Database) -> None:
    before = await held_session(holding)
    started, never = asyncio.Event(), asyncio.Event()

    async def unit(cur: DriverCursor) -> None:
        await cur.execute(SET_N, {"ids": [1], "n": 9})
        started.set()
        await never.wait()

    task = asyncio.create_task(holding.run_driver_write(unit))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert checked_out(holding) == 0
    assert await held_session(holding) != before

    async def killed() -> None:
        assert await alive(holding, {before}) == 0

    await eventually(killed, within_s=5, what="the abandoned session killed")
    assert await rows(holding) == [(1, 0, "a"), (2, 0, "b"), (3, 0, "c")]  # its UPDATE went with it


async def test_a_commit_that_fails_is_unavailable_and_its_session_never_held_again(
    holding: Database, mariadb_url: str
) -> None:
    killer = Database.from_url(mariadb_url, pool_size=1, max_overflow=0, timeout_s=5.0)

    async def unit(cur: DriverCursor) -> None:
        await cur.execute(SET_N, {"ids": [1], "n": 9})
        (session,) = (await cur.rows(SESSION, {}))[0]
        async with killer.write() as conn:
            await conn.execute(sa.text(f"KILL CONNECTION {int(session)}"))  # the unit's last act: COMMIT fails

    try:
        before = await held_session(holding)
        with pytest.raises(StoreUnavailable) as failure:
            await holding.run_driver_write(unit)
        lost = failure.value.__cause__
        assert isinstance(lost, sa.exc.DBAPIError) and lost.statement == "COMMIT" and lost.connection_invalidated
        assert checked_out(holding) == 0
        assert await held_session(holding) != before
        assert await rows(holding) == [(1, 0, "a"), (2, 0, "b"), (3, 0, "c")]
    finally:
        await killer.dispose()


class OutOfSequence:
    """An asyncmy cursor's stand-in whose statement fails as the driver fails on a packet out of sequence."""

    def __init__(self, cursor: Any) -> None:
        self.connection = cursor.connection

    async def execute(self, text: str, args: Any) -> int:
        raise asyncmy_errors.InternalError("Packet sequence number wrong - got 3 expected 1")


async def test_a_driver_error_the_server_did_not_send_discards_the_session(holding: Database) -> None:
    before = await held_session(holding)

    async def unit(cur: DriverCursor) -> None:
        await cur.execute(SET_N, {"ids": [1], "n": 9})
        cur._cursor = OutOfSequence(cur._cursor)
        await cur.execute(SET_N, {"ids": [2], "n": 9})

    with pytest.raises(sa.exc.InternalError) as failure:
        await holding.run_driver_write(unit)
    assert not failure.value.connection_invalidated  # not a disconnect to SQLAlchemy's dialect
    assert checked_out(holding) == 0  # but never rolled back and used again: what it reads next is unknown
    assert await held_session(holding) != before
    assert await rows(holding) == [(1, 0, "a"), (2, 0, "b"), (3, 0, "c")]


async def test_a_unit_that_goes_on_past_a_driver_error_of_its_own_catching_commits_nothing(holding: Database) -> None:
    before = await held_session(holding)

    async def unit(cur: DriverCursor) -> str:
        await cur.execute(SET_N, {"ids": [1], "n": 9})
        driver = cur._cursor
        cur._cursor = OutOfSequence(driver)
        with contextlib.suppress(sa.exc.InternalError):  # a unit that made a driver error its own business
            await cur.execute(SET_N, {"ids": [2], "n": 9})
        cur._cursor = driver
        return "went on"

    # what the connection reads next is unknown: no COMMIT is sent on it, and the caller is told
    with pytest.raises(StoreUnavailable, match="out of step"):
        await holding.run_driver_write(unit)
    assert checked_out(holding) == 0  # discarded, not used again
    assert await held_session(holding) != before
    assert await rows(holding) == [(1, 0, "a"), (2, 0, "b"), (3, 0, "c")]


async def test_a_disconnect_seen_by_a_block_lets_the_idle_held_sessions_go(holding: Database, mariadb_url: str) -> None:
    idle = await concurrent_sessions(holding, 2)
    killer = Database.from_url(mariadb_url, pool_size=1, max_overflow=0, timeout_s=5.0)

    async def block_on_a_killed_session() -> None:
        async with holding.write() as conn:
            (session,) = (await conn.execute(SESSION)).one()
            async with killer.write() as kill:
                await kill.execute(sa.text(f"KILL CONNECTION {int(session)}"))
            await conn.execute(sa.text("SELECT 1"))  # on a connection the server closed

    try:
        with pytest.raises(StoreUnavailable):
            await block_on_a_killed_session()
        assert not await concurrent_sessions(holding, 2) & idle

        async def gone() -> None:
            assert await alive(killer, idle) == 0

        await eventually(gone, within_s=5, what="the idle held sessions closed")
    finally:
        await killer.dispose()


# --------------------------------------------------------------------------- a hung database


@pytest.mark.parametrize("pool_size", [1, 4], ids=["nothing-held", "one-held"])
async def test_a_unit_during_a_blackhole_fails_by_its_deadline_and_its_connection_is_discarded(
    proxy: TcpProxy, mariadb_url: str, pool_size: int
) -> None:
    hung = Database.from_url(through(proxy, mariadb_url), pool_size=pool_size, max_overflow=0, timeout_s=D)

    async def unit(cur: DriverCursor) -> Any:
        proxy.blackhole()
        return await cur.rows(SESSION, {})  # never answered

    try:
        before = await session_id(hung)
        if pool_size > 1:  # the unit runs on a held session
            before = await held_session(hung)
            assert await held_session(hung) == before
        started = time.monotonic()
        with pytest.raises(StoreDeadlineExceeded):
            await hung.run_driver_write(unit)
        assert D * 0.9 <= time.monotonic() - started <= D + SLACK
        assert hung.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        proxy.forward()
        assert await session_id(hung) != before  # the hung session was never reused
        assert await held_session(hung) != before
    finally:
        proxy.forward()
        await hung.dispose()


# --------------------------------------------------------------------------- on SQLite

RETURNING = sa.update(_t).where(_t.c.id.in_(sa.bindparam("ids", expanding=True))).values(n=_t.c.n + 10).returning(
    _t.c.id, _t.c.n
)


@pytest_asyncio.fixture(params=["file", "memory"])
async def lite(tmp_path: Any, request: pytest.FixtureRequest) -> AsyncIterator[Database]:
    # a file: units inline or on a thread (pysqlite); ':memory:': on aiosqlite's connection (run_sync)
    url = f"sqlite+aiosqlite:///{tmp_path}/units.db" if request.param == "file" else "sqlite+aiosqlite://"
    database = Database.from_url(url, timeout_s=5.0)
    async with database.write() as conn:
        await conn.execute(sa.text("CREATE TABLE driver_rows (id INT PRIMARY KEY, n INT, tag TEXT)"))
        await conn.execute(sa.text("INSERT INTO driver_rows VALUES (1, 0, 'a'), (2, 0, 'b'), (3, 0, 'c')"))
    try:
        yield database
    finally:
        await database.dispose()


def sqlite_unit(conn: sa.Connection) -> tuple[int, int, list[tuple[Any, ...]]]:
    cur = SqliteCursor(conn)
    changed = cur.execute(SET_N, {"ids": [1, 2, 99], "n": 5})
    bumped = cur.executemany(BUMP, [{"id": 1}, {"id": 3}, {"id": 98}])
    return changed, bumped, cur.rows(RETURNING, {"ids": [2, 3]})


@pytest.mark.parametrize("where", ["inline", "thread"])
async def test_a_sqlite_unit_commits_its_statements_together_and_counts_changed_rows(
    lite: Database, where: str
) -> None:
    run = lite.run_write if where == "inline" else lite.run_long_write
    inline_before = lite.unit_counts.inline
    changed, bumped, returned = await run(sqlite_unit)
    assert (changed, bumped) == (2, 2)  # the missing ids change nothing
    assert sorted(returned) == [(2, 15), (3, 11)]  # RETURNING's rows, the driver's tuples
    if lite._sync_engine is not None:  # (':memory:' has one connection, no inline units)
        assert (lite.unit_counts.inline > inline_before) == (where == "inline")
    assert await rows(lite) == [(1, 6, "set"), (2, 15, "set"), (3, 11, "c")]


async def test_a_sqlite_drivers_error_is_sqlalchemys_and_rolls_the_unit_back(lite: Database) -> None:
    def unit(conn: sa.Connection) -> None:
        cur = SqliteCursor(conn)
        cur.execute(SET_N, {"ids": [1], "n": 9})
        cur.execute(INSERT, {"id": 2, "n": 1})  # duplicate key

    with pytest.raises(IntegrityError) as failure:
        await lite.run_write(unit)
    assert failure.value.statement is not None and failure.value.statement.startswith("INSERT INTO driver_rows")
    assert not failure.value.connection_invalidated
    assert await rows(lite) == [(1, 0, "a"), (2, 0, "b"), (3, 0, "c")]  # rolled back whole
    assert await lite.run_write(lambda conn: SqliteCursor(conn).execute(SET_N, {"ids": [3], "n": 1})) == 1


async def test_sqlite_statements_are_announced_to_sqlalchemys_listeners(lite: Database) -> None:
    # the units' engine: a listener there sees every unit, inline or not (':memory:': the one engine)
    heard, stop = _announcements(lite._sync_engine or lite.engine.sync_engine)
    try:
        await lite.run_write(lambda conn: SqliteCursor(conn).executemany(BUMP, [{"id": 1}, {"id": 2}]))
    finally:
        stop()
    bump = ("UPDATE driver_rows SET n=(driver_rows.n + ?) WHERE driver_rows.id = ?", [(1, 1), (1, 2)], True)
    assert [h for h in heard if len(h) == 1 or h[1].startswith("UPDATE")] == [
        ("before", *bump),
        ("after", *bump),
        ("commit",),
    ]


async def test_sqlite_rendered_statements_insert_rows_and_count_changed_rows(lite: Database) -> None:
    def unit(conn: sa.Connection) -> tuple[int, int]:
        cur = SqliteCursor(conn)
        cur.insert_rows(RENDERED_INSERT, [{"id": 7, "n": 1, "tag": "one"}])
        cur.insert_rows(RENDERED_INSERT, [{"id": 8, "n": 2, "tag": "x"}, {"id": 9, "n": 3, "tag": "y"}])
        return (
            cur.execute_rendered(RENDERED_BUMP, {"b_id": 8, "b_by": 10}),
            cur.execute_rendered(RENDERED_BUMP, {"b_id": 99, "b_by": 10}),
        )

    assert await lite.run_write(unit) == (1, 0)
    assert (await rows(lite))[3:] == [(7, 1, "one"), (8, 12, "x"), (9, 3, "y")]

    def duplicate(conn: sa.Connection) -> None:
        rows_ = [{"id": 10, "n": 0, "tag": "new"}, {"id": 7, "n": 0, "tag": "dup"}]
        SqliteCursor(conn).insert_rows(RENDERED_INSERT, rows_)

    with pytest.raises(IntegrityError):
        await lite.run_write(duplicate)
    assert len(await rows(lite)) == 6
