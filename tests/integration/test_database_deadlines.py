"""A hung database, for real: MariaDB behind a TCP proxy that blackholes both directions.

The proxy (tests/tcp_proxy.py) keeps every socket open while it drops bytes, and
does not pass a client's close on to the server, as in a partition: a call must
fail on its own deadline, its connection must be discarded, and the server
session it leaves behind must be ended (killed, or by the per-session limits) so
its row locks go. Deadlines are configured to a fraction of a second here; each
test states its bound as a multiple of that deadline ``D``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import pytest_asyncio
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from tests.service.conftest import DIRECT, make_settings
from tests.tcp_proxy import TcpProxy

from roomservice.api.app import ApiContext, create_app
from roomservice.bootstrap import API, MAINTENANCE, OUTBOX, Process
from roomservice.domain import commands as c
from roomservice.outbox.model import ACTIVITY, IM
from roomservice.publishers.fake import FakePublisher
from roomservice.store import tables as t
from roomservice.store.database import Database, _driver
from roomservice.store.port import StoreDeadlineExceeded, StoreUnavailable

T = TypeVar("T")
D = 0.5  # the database deadline these tests configure, in seconds
SLACK = 1.0  # scheduling noise on a shared machine
BASE = "/v1/apps/demo/rooms"


def through(proxy: TcpProxy, url: str) -> str:
    return make_url(url).set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)


async def eventually(probe: Callable[[], Awaitable[T]], *, within_s: float, what: str) -> T:
    """``probe()`` until it returns without raising; its last error after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await probe()
        except Exception:
            if time.monotonic() >= deadline:
                raise AssertionError(f"{what}: still failing after {within_s:g}s") from None
        await asyncio.sleep(0.05)


async def cut_mid_way(db: Database, proxy: TcpProxy, table: str) -> None:
    """A write transaction that takes a row lock, then loses the network for good."""
    async with db.write() as conn:
        await conn.execute(sa.text(f"UPDATE {table} SET n = n + 1 WHERE id = 1"))  # the row lock
        proxy.blackhole()
        await conn.execute(sa.text("SELECT 1"))  # never answered


async def session_id(db: Database) -> int:
    async with db.read() as conn:
        return int((await conn.execute(sa.text("SELECT CONNECTION_ID()"))).scalar_one())


# --------------------------------------------------------------------------- the Database


async def test_a_call_during_a_blackhole_fails_by_its_deadline_and_its_connection_is_discarded(
    proxy: TcpProxy, mariadb_url: str
) -> None:
    db = Database.from_url(through(proxy, mariadb_url), pool_size=1, max_overflow=0, timeout_s=D)
    try:
        before = await session_id(db)
        proxy.blackhole()
        started = time.monotonic()
        with pytest.raises(StoreDeadlineExceeded, match="deadline"):
            await session_id(db)
        assert D * 0.9 <= time.monotonic() - started <= D + SLACK
        # the one pooled connection was not handed back: the next call waits for nothing
        assert db.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await session_id(db)
        assert time.monotonic() - started <= D + SLACK
        proxy.forward()
        after = await eventually(lambda: session_id(db), within_s=4 * D, what="a read after the blackhole")
        assert after != before  # a fresh session: the hung one was never reused
    finally:
        await db.dispose()


async def test_a_block_reads_under_its_deadline_alone_and_pools_its_connection_with_the_drivers_backstop(
    mariadb_url: str,
) -> None:
    """Inside a bounded block the driver's own read timeout is off (every read there is bounded by the
    block's deadline, above; with it, asyncmy waits for each packet under ``asyncio.wait_for``, a task a
    read); the connection goes back to the pool with it, as a read outside any block needs it (the
    maintenance lock's connection)."""
    db = Database.from_url(mariadb_url, pool_size=1, max_overflow=0, timeout_s=D)

    async def pooled_backstop() -> Any:
        conn = await db.engine.connect()  # the one pooled connection, outside any block
        try:
            return _driver(conn).thread_id(), _driver(conn)._read_timeout
        finally:
            await conn.close()

    try:
        session, backstop = await pooled_backstop()
        assert backstop == 2 * D
        async with db.write() as conn:
            assert _driver(conn)._read_timeout is None
            await conn.execute(sa.text("SELECT 1"))
        assert await pooled_backstop() == (session, 2 * D)  # the same connection, its backstop back
        async with db.read() as conn:
            assert _driver(conn)._read_timeout is None
            await conn.execute(sa.text("SELECT 1"))
        assert await pooled_backstop() == (session, 2 * D)
        with pytest.raises(sa.exc.ProgrammingError):  # a failing statement: rolled back, pooled again
            async with db.write() as conn:
                await conn.execute(sa.text("SELECT * FROM no_such_table_here"))
        assert db.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        assert await pooled_backstop() == (session, 2 * D)
    finally:
        await db.dispose()


async def test_a_transaction_cut_mid_way_leaves_no_row_lock_behind(
    proxy: TcpProxy, mariadb_url: str, mariadb_server_url: sa.URL
) -> None:
    """The client gives up and its close never reaches the server (a ghost session holding
    a row lock). Once the server answers again, the session is killed: the row can be
    written from elsewhere long before the server's idle-transaction limit (2 D) would
    have ended it, and long before ``wait_timeout`` (hours) without either."""
    timeout = 3.0  # a wide deadline, so the kill is told apart from the idle limit (2 x 3 s)
    db = Database.from_url(through(proxy, mariadb_url), pool_size=1, max_overflow=0, timeout_s=timeout)
    direct = Database.from_url(mariadb_url, pool_size=1, max_overflow=0, timeout_s=timeout)
    assert db._reaper is not None
    try:
        async with direct.write() as conn:
            await conn.execute(sa.text("CREATE TABLE IF NOT EXISTS deadline_rows (id INT PRIMARY KEY, n INT)"))
            await conn.execute(sa.text("REPLACE INTO deadline_rows VALUES (1, 0)"))
        ghost = await session_id(db)  # the pool's one connection: the one the write will use
        with pytest.raises(StoreDeadlineExceeded):
            await cut_mid_way(db, proxy, "deadline_rows")
        locked_at = time.monotonic() - timeout
        proxy.forward()
        assert proxy.open_upstreams >= 1  # the ghost: its server side never heard of the close

        async def write_the_row() -> None:
            async with direct.write() as conn:
                await conn.execute(sa.text("SET SESSION innodb_lock_wait_timeout = 1"))
                await conn.execute(sa.text("UPDATE deadline_rows SET n = 10 WHERE id = 1"))

        await eventually(write_the_row, within_s=2 * timeout, what="writing the row the ghost had locked")
        assert time.monotonic() - locked_at < 2 * timeout  # before the idle limit: it was the kill
        assert db._reaper.killed == 1
        async with direct.read() as conn:
            alive = (
                await conn.execute(
                    sa.text("SELECT count(*) FROM information_schema.processlist WHERE id = :id"), {"id": ghost}
                )
            ).scalar_one()
            assert alive == 0
            assert (await conn.execute(sa.text("SELECT n FROM deadline_rows WHERE id = 1"))).scalar_one() == 10
    finally:
        async with direct.write() as conn:
            await conn.execute(sa.text("DROP TABLE IF EXISTS deadline_rows"))
        await db.dispose()
        await direct.dispose()


async def test_the_server_ends_an_abandoned_transaction_by_itself(proxy: TcpProxy, mariadb_url: str) -> None:
    """Even when no kill can reach it, the session limits end the ghost: its lock goes
    within idle_transaction_timeout (2 D, whole seconds) of its last statement."""
    db = Database.from_url(through(proxy, mariadb_url), pool_size=1, max_overflow=0, timeout_s=D)
    direct = Database.from_url(mariadb_url, pool_size=1, max_overflow=0, timeout_s=5.0)
    try:
        async with direct.write() as conn:
            await conn.execute(sa.text("CREATE TABLE IF NOT EXISTS deadline_rows2 (id INT PRIMARY KEY, n INT)"))
            await conn.execute(sa.text("REPLACE INTO deadline_rows2 VALUES (1, 0)"))
        assert db._reaper is not None
        db._reaper.kill = lambda thread_id: None  # type: ignore[method-assign]  # no kill this time
        with pytest.raises(StoreDeadlineExceeded):
            await cut_mid_way(db, proxy, "deadline_rows2")
        locked_at = time.monotonic() - D

        async def write_the_row() -> None:
            async with direct.write() as conn:
                await conn.execute(sa.text("SET SESSION innodb_lock_wait_timeout = 1"))
                await conn.execute(sa.text("UPDATE deadline_rows2 SET n = 10 WHERE id = 1"))

        await eventually(write_the_row, within_s=3 + SLACK, what="writing the row the ghost had locked")
        assert time.monotonic() - locked_at <= 1 + 1 + SLACK  # ceil(2 D) = 1 s idle limit, + a lock wait
    finally:
        proxy.forward()
        async with direct.write() as conn:
            await conn.execute(sa.text("DROP TABLE IF EXISTS deadline_rows2"))
        await db.dispose()
        await direct.dispose()


# --------------------------------------------------------------------------- the whole service


@pytest_asyncio.fixture
async def service_through_proxy(
    fresh_mariadb_url: str, proxy: TcpProxy, tmp_path: Path
) -> AsyncIterator[tuple[Process, httpx.AsyncClient, dict[str, FakePublisher]]]:
    settings = make_settings(
        through(proxy, fresh_mariadb_url),
        tmp_path,
        **DIRECT,  # the fault is the database: the targets are fakes
        **{
            "database.timeout": f"{int(D * 1000)}ms",
            "outbox_worker.poll_interval": "100ms",
            "outbox_worker.publish_timeout": "500ms",
            "outbox_worker.lock_timeout": "3s",
        },
    )
    fakes = {IM: FakePublisher(IM), ACTIVITY: FakePublisher(ACTIVITY)}
    async with Process.running(settings, roles=(API, OUTBOX, MAINTENANCE), publishers=fakes) as process:
        app = create_app(ApiContext(service=process.service, health=process.health, admin_token="t"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://room.test") as http:
            yield process, http, fakes


async def _post(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    return await http.post(path, json=body)


async def test_a_hung_database_fails_commands_fast_reports_not_ready_and_everything_recovers(
    service_through_proxy: tuple[Process, httpx.AsyncClient, dict[str, FakePublisher]],
    proxy: TcpProxy,  # after the service: closed (its ghost sessions with it) before the database is dropped
) -> None:
    process, http, _ = service_through_proxy
    async def create(room: str) -> None:
        body = {"command_id": f"create-{room}", "room_id": room, "owner_id": "o", "title": "t"}
        created = await _post(http, BASE, body)
        assert created.status_code == 200, created.text

    # The deadline is short (D) and the first statements of a fresh pool can outlast it on a
    # loaded machine; a client retries a 503 with the same command_id, and so does this setup.
    for room in ("r1", "cut"):
        await eventually(functools.partial(create, room), within_s=10 * D, what=f"creating {room}")
    ready = await http.get("/readyz")
    assert ready.status_code == 200, ready.text

    # A join on "cut" whose transaction is cut after its row lock was taken.
    cut_once: list[bool] = []

    @sa.event.listens_for(process.db.engine.sync_engine, "after_cursor_execute")
    def cut(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if not cut_once and statement.startswith("UPDATE room_meta") and "cut" in str(parameters):
            cut_once.append(True)
            proxy.blackhole()

    started = time.monotonic()
    answer = await _post(http, f"{BASE}/cut/join", {"command_id": "j-cut-1", "user_id": "u1"})
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "unavailable"
    assert time.monotonic() - started <= D + SLACK
    sa.event.remove(process.db.engine.sync_engine, "after_cursor_execute", cut)

    # Meanwhile every command fails within the deadline, and readiness says why.
    started = time.monotonic()
    answer = await _post(http, f"{BASE}/r1/join", {"command_id": "j-r1-1", "user_id": "u1"})
    assert (answer.status_code, answer.json()["error"]["code"]) == (503, "unavailable")
    assert time.monotonic() - started <= D + SLACK

    async def not_ready() -> dict[str, Any]:
        response = await http.get("/readyz")
        body: dict[str, Any] = response.json()
        assert response.status_code == 503
        assert body["checks"]["database"].startswith("error")
        assert body["checks"]["outbox_worker"].startswith("error")
        return body

    await eventually(not_ready, within_s=4 * D + SLACK, what="/readyz reporting the hung database")

    proxy.forward()

    # Within seconds: both rooms take writes again (the cut one's row lock is gone) ...
    async def join(room: str, user: str) -> None:
        response = await _post(http, f"{BASE}/{room}/join", {"command_id": f"j-{room}-{user}", "user_id": user})
        assert response.status_code == 200, response.text

    await eventually(lambda: join("cut", "u2"), within_s=10 * D, what="a join on the room whose commit was cut")
    await eventually(lambda: join("r1", "u2"), within_s=10 * D, what="a join on the other room")

    # ... readiness is back ...
    async def ready_again() -> None:
        response = await http.get("/readyz")
        assert response.status_code == 200, response.text
        assert response.json()["checks"]["database"] == "ok"
        assert response.json()["checks"]["outbox_worker"] == "ok"

    await eventually(ready_again, within_s=10 * D, what="/readyz after the database answers again")

    # ... and the worker, which survived, drains the outbox.
    assert process.worker is not None and process.worker.alive

    async def drained() -> None:
        async with process.db.read() as conn:
            left = (
                await conn.execute(
                    sa.select(sa.func.count()).select_from(t.room_outbox).where(t.room_outbox.c.status != "delivered")
                )
            ).scalar_one()
        assert left == 0

    await eventually(drained, within_s=10 * D, what="the outbox draining")


async def test_stopping_during_a_blackhole_is_bounded(fresh_mariadb_url: str, proxy: TcpProxy, tmp_path: Path) -> None:
    settings = make_settings(
        through(proxy, fresh_mariadb_url),
        tmp_path,
        **DIRECT,
        **{"database.timeout": f"{int(D * 1000)}ms", "outbox_worker.publish_timeout": "500ms"},
    )
    fakes = {IM: FakePublisher(IM), ACTIVITY: FakePublisher(ACTIVITY)}
    async with Process.running(settings, roles=(API, OUTBOX, MAINTENANCE), publishers=fakes) as process:
        await process.service.execute("demo", "r1", "c1", c.CreateRoom(owner_id="o", title="t"))
        proxy.blackhole()
        await asyncio.sleep(D)  # the worker is in a hung call now
        started = time.monotonic()
    # the worker's grace (publish_timeout) + its hand-back (D) + the pool's disposal (D)
    assert time.monotonic() - started <= 0.5 + 2 * D + SLACK


async def test_under_load_no_room_stays_wedged_after_the_partition_heals(
    service_through_proxy: tuple[Process, httpx.AsyncClient, dict[str, FakePublisher]],
    proxy: TcpProxy,
) -> None:
    """The fault probe in small: a client per room keeps joining while the database hangs
    for 4 D. No request waits much past the deadline, and once the database answers every
    room takes writes again within seconds (the probe saw a third of its rooms hang for
    minutes), and the outbox drains."""
    process, http, _ = service_through_proxy
    rooms = [f"load{n}" for n in range(16)]
    for room in rooms:
        body = {"command_id": f"create-{room}", "room_id": room, "owner_id": "o", "title": "t"}
        assert (await _post(http, BASE, body)).status_code == 200
    stop = asyncio.Event()
    latencies: list[float] = []
    statuses: list[int] = []

    async def client(room: str) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            started = time.monotonic()
            response = await _post(http, f"{BASE}/{room}/join", {"command_id": f"{room}-{n}", "user_id": f"u{n}"})
            latencies.append(time.monotonic() - started)
            statuses.append(response.status_code)
            assert response.status_code in (200, 503), response.text

    clients = [asyncio.create_task(client(room)) for room in rooms]
    try:
        await asyncio.sleep(0.3)  # load on every room
        proxy.blackhole()
        await asyncio.sleep(4 * D)
        proxy.forward()
        await asyncio.sleep(0.3)
    finally:
        stop.set()
        await asyncio.gather(*clients)
    assert 503 in statuses and 200 in statuses
    assert max(latencies) <= 2 * D + SLACK  # a call that hangs fails by D; its command answers

    async def every_room_takes_a_write() -> None:
        for room in rooms:
            response = await _post(http, f"{BASE}/{room}/join", {"command_id": f"{room}-after", "user_id": "late"})
            assert response.status_code == 200, (room, response.text)

    await eventually(every_room_takes_a_write, within_s=10 * D, what="every room taking writes again")

    async def drained() -> None:
        async with process.db.read() as conn:
            left = (
                await conn.execute(
                    sa.select(sa.func.count()).select_from(t.room_outbox).where(t.room_outbox.c.status != "delivered")
                )
            ).scalar_one()
        assert left == 0

    await eventually(drained, within_s=10 * D, what="the outbox draining")
