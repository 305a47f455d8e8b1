"""Bare-driver baselines: the seed's statements through asyncmy, sqlite3 and nats-py, nothing of ours in between.

Every benchmark prints its figure as a ratio against one of these, measured in
the same run (issue 12: "honest baselines"):

* :func:`write_rate` — the write path's transaction: guarded ``room_meta``
  update, command log insert, outbox insert, one transaction per command,
  ``concurrency`` callers over the rooms. MariaDB: asyncmy, one connection per
  caller (at most 64, as the service's pool), READ COMMITTED like the store. SQLite: stdlib ``sqlite3`` on the
  event loop's thread (WAL, ``synchronous=NORMAL``, ``BEGIN IMMEDIATE``): one
  writer, so the callers take turns and the figure is the driver's own rate.
* :class:`RawSqlite` / :class:`RawMariaDB` — the outbox worker's claim and
  guarded finish, written out (the drain baselines).

SQLAlchemy appears only in setup (the schema comes from the project's own
migrations, so both sides write the same tables and indexes).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any

from sqlalchemy.engine import make_url

from bench.common import run_concurrently

APP = "bench"
LOCK_MS = 30_000
MAX_CONNECTIONS = 64


def owner_name(kind: str, i: int) -> str:
    """A claim owner of the shape the worker gives itself (``worker-`` and 12 characters: 19), for the
    workers and the bare loops alike. The owner is written into a claimed row and cleared by its finish,
    so its length decides whether InnoDB updates the row in place: with ``w0`` for the workers and
    ``raw0`` for the bare loops the worker's finish took 8.1-8.9 ms a 200-row batch and the bare loop's
    3.4 ms; with 19 characters for both, 4.2-5.0 and 3.2 ms."""
    return f"worker-{kind}{i:011d}"


CYCLE_OWNER = owner_name("c", 0)  # the bare claim + finish cycle's

# --------------------------------------------------------------------------- the write path's statements

_META_COLUMNS = (
    "app_code, room_id, version, lease_epoch, owner_id, title, status, seat_count, member_count, heat, "
    "created_at_ms, updated_at_ms"
)
_META_UPDATE = (
    "UPDATE room_meta SET version = {p}, status = {p}, title = {p}, member_count = {p}, heat = {p}, "
    "updated_at_ms = {p} WHERE app_code = {p} AND room_id = {p} AND version = {p} AND lease_epoch = {p}"
)
_LOG_INSERT = (
    "INSERT INTO room_command_log (app_code, room_id, command_id, command_type, fingerprint, command, events, "
    "response, version, now_ms, created_at_ms, timing) VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, "
    "{p})"
)
_OUTBOX_INSERT = (
    "INSERT INTO room_outbox (event_id, app_code, room_id, room_version, event_type, payload, status, targets_done, "
    "due_at_ms, created_at_ms, updated_at_ms) VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p})"
)


Sizes = tuple[int, int, int, int, int]  # bytes of command, events, response, timing (log row), outbox payload


def _sql(template: str, placeholder: str) -> str:
    return template.replace("{p}", placeholder)


class WriteShape:
    """The rows one JoinRoom writes, with the sizes the real run wrote (command, events, response, timing,
    outbox payload)."""

    def __init__(self, rooms: int, sizes: Sizes) -> None:
        self.rooms, self.sizes = rooms, sizes
        self._versions = dict.fromkeys(range(self.rooms), 1)
        command_len, events_len, response_len, timing_len, payload_len = self.sizes
        self._blobs = ("c" * command_len, "e" * events_len, "r" * response_len, "t" * timing_len, b"p" * payload_len)

    def meta_seed(self) -> list[tuple[Any, ...]]:
        return [(APP, f"room{r}", 1, 0, "owner", "b", "open", 8, 1, 0, 0, 0) for r in range(self.rooms)]

    def rows(self, i: int) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
        room = i % self.rooms
        version = self._versions[room]
        self._versions[room] = version + 1
        now = time.time_ns() // 1_000_000
        command, events, response, timing, payload = self._blobs
        room_id = f"room{room}"
        meta = (version + 1, "open", "b", version, 0, now, APP, room_id, version, 0)
        log = (APP, room_id, f"join-{i}", "JoinRoom", "f" * 64, command, events, response, version + 1, now, now,
               timing)
        outbox = (f"ev-{i}", APP, room_id, version + 1, "RoomUserJoined", payload, "pending", "", now, now, now)
        return meta, log, outbox


async def write_rate(url: str, *, commands: int, sizes: Sizes, concurrency: int,
                     rooms: int) -> dict[str, Any]:
    """Transactions/s and per-transaction latencies (ms) of the bare driver; ``url`` holds the migrated schema."""
    shape = WriteShape(rooms, sizes)
    if url.startswith("sqlite"):
        return await _sqlite_write_rate(url, shape, commands, concurrency)
    return await _mariadb_write_rate(url, shape, commands, concurrency)


def sqlite_connect(url: str) -> sqlite3.Connection:
    path = make_url(url).database
    assert path
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    for pragma in ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=NORMAL", "PRAGMA busy_timeout=5000"):
        conn.execute(pragma)
    return conn


async def _sqlite_write_rate(url: str, shape: WriteShape, commands: int, concurrency: int) -> dict[str, Any]:
    conn = sqlite_connect(url)
    update, log_insert, outbox_insert = (_sql(s, "?") for s in (_META_UPDATE, _LOG_INSERT, _OUTBOX_INSERT))
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(f"INSERT INTO room_meta ({_META_COLUMNS}) VALUES ({', '.join('?' * 12)})", shape.meta_seed())
        conn.execute("COMMIT")

        async def one(i: object) -> None:
            meta, log, outbox = shape.rows(int(i))  # type: ignore[call-overload]
            conn.execute("BEGIN IMMEDIATE")
            if conn.execute(update, meta).rowcount != 1:
                raise AssertionError(f"bare sqlite3: guarded update missed {meta}")
            conn.execute(log_insert, log)
            conn.execute(outbox_insert, outbox)
            conn.execute("COMMIT")

        start, cpu = time.perf_counter(), time.process_time()
        latencies = await run_concurrently(concurrency, list(range(commands)), one)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        conn.close()
    return {"cps": commands / elapsed, "latencies": latencies, "cpu_us": cpu / commands * 1e6}


async def mariadb_connect(url: str) -> Any:
    import asyncmy

    u = make_url(url)
    conn = await asyncmy.connect(
        host=u.host or "127.0.0.1",
        port=u.port or 3306,
        user=u.username or "root",
        password=u.password or "",
        database=u.database,
        charset="utf8mb4",
        autocommit=False,
    )
    async with conn.cursor() as cur:
        await cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
    await conn.commit()
    return conn


async def _mariadb_write_rate(url: str, shape: WriteShape, commands: int, concurrency: int) -> dict[str, Any]:
    update, log_insert, outbox_insert = (_sql(s, "%s") for s in (_META_UPDATE, _LOG_INSERT, _OUTBOX_INSERT))
    # a connection per caller, up to MAX_CONNECTIONS (the server's max_connections is shared with
    # every other client); beyond it callers wait for a free one, as they would on a pool
    conns = [await mariadb_connect(url) for _ in range(min(concurrency, MAX_CONNECTIONS))]
    try:
        async with conns[0].cursor() as cur:
            await cur.executemany(
                f"INSERT INTO room_meta ({_META_COLUMNS}) VALUES ({', '.join(['%s'] * 12)})", shape.meta_seed()
            )
        await conns[0].commit()
        free: asyncio.Queue[Any] = asyncio.Queue()
        for conn in conns:
            free.put_nowait(conn)

        # one transaction of a room at a time, in order (as a room's cell takes turns): with more callers
        # than connections a later command of a room could otherwise overtake an earlier one
        turns = [asyncio.Lock() for _ in range(shape.rooms)]

        async def one(i: object) -> None:
            async with turns[int(i) % shape.rooms]:  # type: ignore[call-overload]
                await write(int(i))  # type: ignore[call-overload]

        async def write(i: int) -> None:
            meta, log, outbox = shape.rows(i)
            conn = await free.get()
            try:
                async with conn.cursor() as cur:
                    if await cur.execute(update, meta) != 1:
                        raise AssertionError(f"bare asyncmy: guarded update missed {meta}")
                    await cur.execute(log_insert, log)
                    await cur.execute(outbox_insert, outbox)
                await conn.commit()
            finally:
                free.put_nowait(conn)

        start, cpu = time.perf_counter(), time.process_time()
        latencies = await run_concurrently(concurrency, list(range(commands)), one)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        for conn in conns:
            conn.close()
    return {"cps": commands / elapsed, "latencies": latencies, "cpu_us": cpu / commands * 1e6}


# --------------------------------------------------------------------------- the outbox worker's claim and finish

_COLUMNS = (
    "id, event_id, app_code, room_id, room_version, event_type, payload, retry_count, targets_done, created_at_ms"
)

# The worker's SQLite claim (roomservice.outbox.sql.SQLITE_CLAIM), written out.
_SQLITE_CLAIM = f"""
UPDATE room_outbox SET status = 'delivering', lock_until_ms = :until, lock_owner = :owner, due_at_ms = :until,
       updated_at_ms = :now
WHERE id IN (
  SELECT id FROM (
    SELECT id, 0 AS priority, due FROM (
      SELECT id, due_at_ms AS due FROM room_outbox WHERE status = 'pending' ORDER BY due_at_ms LIMIT :limit)
    UNION ALL SELECT id, 1 AS priority, due FROM (
      SELECT id, due_at_ms AS due FROM room_outbox WHERE status = 'retryable' AND due_at_ms <= :now
      ORDER BY due_at_ms LIMIT :limit)
    UNION ALL SELECT id, 2 AS priority, due FROM (
      SELECT id, due_at_ms AS due FROM room_outbox WHERE status = 'delivering' AND due_at_ms <= :now
      ORDER BY due_at_ms LIMIT :limit)
  ) ORDER BY priority, due LIMIT :limit)
RETURNING {_COLUMNS}
"""
_FINISH_SET = (
    "UPDATE room_outbox SET status = 'delivered', lock_until_ms = NULL, lock_owner = NULL, last_error = NULL, "
    "targets_done = {p}, due_at_ms = {p}, updated_at_ms = {p}, delivered_at_ms = {p} "
    "WHERE id IN ({ids}) AND status = 'delivering' AND lock_owner = {p}"
)
_MYSQL_CLAIM_SELECT = (
    f"SELECT {_COLUMNS} FROM room_outbox WHERE status = %s {{due}}ORDER BY due_at_ms LIMIT %s FOR UPDATE SKIP LOCKED"
)
_MYSQL_MARK = (
    "UPDATE room_outbox SET status = 'delivering', lock_until_ms = %s, lock_owner = %s, due_at_ms = %s, "
    "updated_at_ms = %s WHERE id IN ({ids})"
)


class RawSqlite:
    """sqlite3 (stdlib) on the loop's thread: WAL, synchronous=NORMAL, BEGIN IMMEDIATE per write."""

    def __init__(self, url: str) -> None:
        self.conn = sqlite_connect(url)

    async def claim(self, owner: str, now: int, limit: int) -> list[tuple[Any, ...]]:
        self.conn.execute("BEGIN IMMEDIATE")
        rows = self.conn.execute(
            _SQLITE_CLAIM, {"owner": owner, "now": now, "until": now + LOCK_MS, "limit": limit}
        ).fetchall()
        self.conn.execute("COMMIT")
        return rows

    async def finish(self, owner: str, now: int, ids: list[int], target: str = "broker") -> int:
        sql = _FINISH_SET.format(p="?", ids=",".join("?" * len(ids)))
        self.conn.execute("BEGIN IMMEDIATE")
        changed = self.conn.execute(sql, [target, now, now, now, *ids, owner]).rowcount
        self.conn.execute("COMMIT")
        return changed

    async def close(self) -> None:
        self.conn.close()


class RawMariaDB:
    """asyncmy, READ COMMITTED: the worker's claim SELECTs (FOR UPDATE SKIP LOCKED) + UPDATE by id, then finish."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    @classmethod
    async def connect(cls, url: str) -> RawMariaDB:
        return cls(await mariadb_connect(url))

    async def claim(self, owner: str, now: int, limit: int) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = []
        async with self.conn.cursor() as cur:
            for status, due in (
                ("pending", ""),
                ("retryable", "AND due_at_ms <= %s "),
                ("delivering", "AND due_at_ms <= %s "),
            ):
                missing = limit - len(rows)
                if missing <= 0:
                    break
                params = (status, now, missing) if due else (status, missing)
                await cur.execute(_MYSQL_CLAIM_SELECT.format(due=due), params)
                rows.extend(await cur.fetchall())
            if rows:
                ids = [r[0] for r in rows]
                await cur.execute(
                    _MYSQL_MARK.format(ids=",".join(["%s"] * len(ids))),
                    (now + LOCK_MS, owner, now + LOCK_MS, now, *ids),
                )
        await self.conn.commit()
        return rows

    async def finish(self, owner: str, now: int, ids: list[int], target: str = "broker") -> int:
        async with self.conn.cursor() as cur:
            changed = await cur.execute(
                _FINISH_SET.format(p="%s", ids=",".join(["%s"] * len(ids))), (target, now, now, now, *ids, owner)
            )
        await self.conn.commit()
        return int(changed)

    async def close(self) -> None:
        self.conn.close()


class DrainWatch:
    """Whether a drain has rows left, looked up on one connection held for the drain (the bare driver):
    a poll looks for one row not delivered yet through the status index. (A count of the delivered rows
    through a new SQLAlchemy engine each poll cost the bench's process ~8 % of a core and the server a
    walk over every delivered row, 20 times a second, on the cores the drain runs on.)"""

    _LEFT = "SELECT 1 FROM room_outbox WHERE status IN ('pending', 'retryable', 'delivering') LIMIT 1"
    _DELIVERED = "SELECT COUNT(*) FROM room_outbox WHERE status = 'delivered'"

    def __init__(self, sqlite: sqlite3.Connection | None, mariadb: Any) -> None:
        self._sqlite, self._mariadb = sqlite, mariadb

    @classmethod
    async def open(cls, url: str) -> DrainWatch:
        if url.startswith("sqlite"):
            return cls(sqlite_connect(url), None)
        return cls(None, await mariadb_connect(url))

    async def _one(self, sql: str) -> tuple[Any, ...] | None:
        if self._sqlite is not None:
            row: tuple[Any, ...] | None = self._sqlite.execute(sql).fetchone()
            return row
        async with self._mariadb.cursor() as cur:  # READ COMMITTED: each look sees the latest commits
            await cur.execute(sql)
            return await cur.fetchone()  # type: ignore[no-any-return]

    async def rows_left(self) -> bool:
        return await self._one(self._LEFT) is not None

    async def delivered(self) -> int:
        row = await self._one(self._DELIVERED)
        return int(row[0]) if row else 0

    async def close(self) -> None:
        if self._sqlite is not None:
            self._sqlite.close()
        else:
            self._mariadb.close()


async def open_raw(url: str) -> RawSqlite | RawMariaDB:
    return RawSqlite(url) if url.startswith("sqlite") else await RawMariaDB.connect(url)


async def claim_finish_cycles(url: str, cycles: int, *, rate: float | None = None) -> list[float]:
    """Latency (ms) of one bare claim + finish cycle (two transactions), ``cycles`` times; rows must be pending.

    Back to back by default (200 cycles take well under a second); with ``rate``, one cycle every
    ``1/rate`` s (open loop), so that the p99 samples as long a stretch of the machine's time as a
    latency run paced at that rate (on a shared machine, a second of cycles rarely meets the
    preemptions a ten-second run meets)."""
    store = await open_raw(url)
    latencies = []
    paced_from = time.perf_counter()
    try:
        for i in range(cycles):
            if rate is not None:
                delay = paced_from + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            start = time.perf_counter()
            claimed = await store.claim(CYCLE_OWNER, time.time_ns() // 1_000_000, 1)
            await store.finish(CYCLE_OWNER, time.time_ns() // 1_000_000, [r[0] for r in claimed])
            latencies.append((time.perf_counter() - start) * 1000)
    finally:
        await store.close()
    return latencies
