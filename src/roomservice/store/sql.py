"""``SqlRoomStore``: the :class:`RoomStore` port on SQLite and MySQL/MariaDB through SQLAlchemy Core.

The hot paths are built for few round trips: ``save_mutation`` is its share of one
guarded room_meta UPDATE and two INSERTs (command log rows, outbox rows) in a
write transaction shared with the mutations of other rooms that arrived together
(:mod:`roomservice.store.group_commit`), and ``load_room`` is one statement that reads
room meta, the newest snapshot and the logged events after it from the same
consistent read. Statements are built once, at import or construction; rows
are built before the transaction starts; each operation is one unit handed to
:meth:`Database.run_write` / :meth:`Database.run_read` (inline on the loop's thread
on SQLite). A save is written once, as a coroutine over
:class:`~roomservice.store.port.Writes`, its statements (and its attached write's) on
the driver's cursor (:mod:`roomservice.store.writes`).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Sequence
from typing import Any, Final

import orjson
from sqlalchemy import (
    CompoundSelect,
    Connection,
    Executable,
    Insert,
    Row,
    Select,
    Text,
    Update,
    and_,
    bindparam,
    case,
    cast,
    delete,
    exists,
    func,
    insert,
    literal_column,
    null,
    or_,
    select,
    text,
    union_all,
    update,
)
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.sql.elements import BindParameter, TextClause

from roomservice import errors, wire
from roomservice.domain.decider import replay
from roomservice.domain.events import Event
from roomservice.domain.state import CLOSED, RoomState
from roomservice.observability.logging import get_logger
from roomservice.store.database import Database
from roomservice.store.group_commit import Failed, GroupCommit
from roomservice.store.port import (
    Answer,
    CommandIdTaken,
    LoadedRoom,
    LoggedCommand,
    Mutation,
    NeedsOwnTransaction,
    RoomSummary,
    StoreConflict,
    StoreInconsistent,
    Writes,
)
from roomservice.store.tables import (
    room_command_log,
    room_meta,
    room_outbox,
    room_snapshot,
)
from roomservice.store.writes import run_reads, run_writes

OUTBOX_PENDING: Final = "pending"


def dump_json(value: Any) -> str:
    """Compact JSON, UTF-8 kept as is: the form every JSON column is written in.

    orjson: the command log row's three documents were a fifth of a command's CPU with the
    stdlib encoder (py-spy, issue 12); the output is the same compact form."""
    return orjson.dumps(value).decode()


# --------------------------------------------------------------------------- statements

_meta, _log, _snap, _outbox = room_meta, room_command_log, room_snapshot, room_outbox
_logger = get_logger("roomservice.store")

_IS_ROOM_META = (_meta.c.app_code == bindparam("b_app_code")) & (_meta.c.room_id == bindparam("b_room_id"))
_META_GUARD = (
    _IS_ROOM_META & (_meta.c.version == bindparam("b_expected_version")) & (_meta.c.lease_epoch == bindparam("b_epoch"))
)

_INSERT_META: Final = insert(_meta)
_UPDATE_META: Final = (
    update(_meta)
    .where(_META_GUARD)
    .values(
        version=bindparam("version"),
        status=bindparam("status"),
        title=bindparam("title"),
        member_count=bindparam("member_count"),
        heat=bindparam("heat"),
        updated_at_ms=bindparam("updated_at_ms"),
    )
)
# A no-op command changes no meta, but still must prove the cell owns the room
# at this version; the self-assignment matches (and row-locks) without changing.
_TOUCH_META: Final = update(_meta).where(_META_GUARD).values(lease_epoch=_meta.c.lease_epoch)

# The guarded updates of a batch in one statement, its row count (rows matched) saying whether
# every guard held; which one did not, it cannot say (see _save_mutations_together).
# On MySQL/MariaDB each room's WHERE term is its own guard, and each changed column takes the
# room's value from a CASE on its key. SQLite joins the table to a VALUES list of the rooms (key,
# guard, values; UPDATE ... FROM): the CASE shape cost SQLite ~6 us a room more to run (each CASE
# tries every room's key) and milliseconds to compile a shape on a connection's first use of it
# (its WHERE and CASE terms compared pairwise), ~0.4 ms for the VALUES shape of 32 rooms.
_CHANGED_COLUMNS: Final = ("version", "status", "title", "member_count", "heat", "updated_at_ms")
_GUARD_KEYS: Final = ("b_app_code", "b_room_id", "b_expected_version", "b_epoch")
# rooms a statement at most: a SQLite batch of 256 is a few statements, none of them huge
_MAX_ROOMS_AN_UPDATE: Final = 32
_SQLITE_UPDATE_FROM: Final = sqlite3.sqlite_version_info >= (3, 33, 0)  # UPDATE ... FROM came with 3.33
_UPDATES_OF: dict[tuple[int, bool], Update | TextClause] = {}  # by room count and SQLite; for execute_rendered


def _guarded_updates(rooms: int, *, sqlite: bool) -> Update | TextClause:
    """The guarded meta UPDATE of ``rooms`` rooms at once; parameter ``<key><i>`` is room i's."""
    statement = _UPDATES_OF.get((rooms, sqlite))
    if statement is None:
        build = _guarded_updates_from_values if sqlite and _SQLITE_UPDATE_FROM else _guarded_updates_by_case
        statement = _UPDATES_OF[rooms, sqlite] = build(rooms)
    return statement


def _guarded_updates_by_case(rooms: int) -> Update:
    is_room = [
        (_meta.c.app_code == bindparam(f"b_app_code{i}")) & (_meta.c.room_id == bindparam(f"b_room_id{i}"))
        for i in range(rooms)
    ]
    guards = [
        and_(
            is_room[i],
            _meta.c.version == bindparam(f"b_expected_version{i}"),
            _meta.c.lease_epoch == bindparam(f"b_epoch{i}"),
        )
        for i in range(rooms)
    ]
    values = {
        column: case(*((is_room[i], bindparam(f"{column}{i}")) for i in range(rooms)), else_=_meta.c[column])
        for column in _CHANGED_COLUMNS
    }
    return update(_meta).where(or_(*guards)).values(**values)


def _guarded_updates_from_values(rooms: int) -> TextClause:
    # a VALUES subquery's columns are column1, column2, ... (a CTE could name them, but Python's
    # sqlite3 gives no row count for a statement that does not start with UPDATE)
    names = (*_GUARD_KEYS, *_CHANGED_COLUMNS)
    column = {name: f"v.column{n}" for n, name in enumerate(names, start=1)}
    rows = ", ".join("(" + ", ".join(f":{name}{i}" for name in names) + ")" for i in range(rooms))
    sets = ", ".join(f"{name} = {column[name]}" for name in _CHANGED_COLUMNS)
    guarded = zip(("app_code", "room_id", "version", "lease_epoch"), _GUARD_KEYS, strict=True)
    where = " AND ".join(f"{_meta.name}.{name} = {column[key]}" for name, key in guarded)
    return text(f"UPDATE {_meta.name} SET {sets} FROM (VALUES {rows}) AS v WHERE {where}")


_INSERT_COMMAND: Final = insert(_log)
_INSERT_OUTBOX: Final = insert(_outbox)

# (+ a literal 1, not a bound one: execute_rendered takes only the parameters it is given)
_BUMP_EPOCH: Final = update(_meta).where(_IS_ROOM_META).values(lease_epoch=_meta.c.lease_epoch + literal_column("1"))
_SELECT_EPOCH: Final = select(_meta.c.lease_epoch).where(_IS_ROOM_META)

_FIND_COMMAND: Final = select(
    _log.c.command_id, _log.c.fingerprint, _log.c.response, _log.c.version, _log.c.command_type
).where(
    _log.c.app_code == bindparam("app_code"),
    _log.c.room_id == bindparam("room_id"),
    _log.c.command_id == bindparam("command_id"),
)


def _build_load_room() -> CompoundSelect[int, int, int, str | None]:
    """Meta, newest snapshot and the non-empty log rows after it, in one statement.

    One statement is one consistent read on both backends, so the snapshot and
    the log after it can never be seen from two different moments (a prune
    between two SELECTs could otherwise hide events). Rows come back as
    ``(kind, version, seq, doc)``: kind 0 = meta (seq = lease epoch), 1 =
    snapshot (doc = state), 2 = command log (seq = id, doc = events).
    """
    app: BindParameter[str] = bindparam("app_code")
    room: BindParameter[str] = bindparam("room_id")
    newest_snapshot = (
        select(func.max(_snap.c.version)).where(_snap.c.app_code == app, _snap.c.room_id == room).scalar_subquery()
    )
    meta = select(
        literal_column("0").label("kind"),
        _meta.c.version.label("version"),
        _meta.c.lease_epoch.label("seq"),
        cast(null(), Text()).label("doc"),
    ).where(_meta.c.app_code == app, _meta.c.room_id == room)
    snapshot = select(literal_column("1"), _snap.c.version, literal_column("0"), _snap.c.state).where(
        _snap.c.app_code == app, _snap.c.room_id == room, _snap.c.version == newest_snapshot
    )
    log = select(literal_column("2"), _log.c.version, _log.c.id, _log.c.events).where(
        _log.c.app_code == app,
        _log.c.room_id == room,
        _log.c.version > func.coalesce(newest_snapshot, 0),
        _log.c.events != "[]",  # no-op commands: logged for idempotency, nothing to replay
    )
    return union_all(meta, snapshot, log).order_by(
        literal_column("kind"), literal_column("version"), literal_column("seq")
    )


_LOAD_ROOM: Final = _build_load_room()
_KIND_META, _KIND_SNAPSHOT, _KIND_LOG = 0, 1, 2

_NTH_NEWEST_SNAPSHOT: Final = (
    select(_snap.c.version)
    .where(_snap.c.app_code == bindparam("app_code"), _snap.c.room_id == bindparam("room_id"))
    .order_by(_snap.c.version.desc())
    .limit(1)
    .offset(bindparam("skip"))
)
_DELETE_OLD_SNAPSHOTS: Final = delete(_snap).where(
    _snap.c.app_code == bindparam("app_code"),
    _snap.c.room_id == bindparam("room_id"),
    _snap.c.version < bindparam("below_version"),
)

_PING: Final[Select[Any]] = select(literal_column("1"))

_LIST_SUMMARIES: Final = (
    select(
        _meta.c.app_code,
        _meta.c.room_id,
        _meta.c.owner_id,
        _meta.c.title,
        _meta.c.status,
        _meta.c.version,
        _meta.c.member_count,
        _meta.c.heat,
        _meta.c.updated_at_ms,
    )
    # open rooms only: the limit must not be spent on closed ones (they dropped open rooms from a rebuild)
    .where(_meta.c.status != CLOSED)
    .order_by(_meta.c.updated_at_ms.desc(), _meta.c.app_code, _meta.c.room_id)
    .limit(bindparam("limit"))
)

# Only rows that a snapshot already covers may go: recovery never needs them again.
_PRUNABLE_COMMANDS: Final = (
    select(_log.c.id)
    .where(
        _log.c.created_at_ms < bindparam("before_ms"),
        exists()
        .where(
            _snap.c.app_code == _log.c.app_code,
            _snap.c.room_id == _log.c.room_id,
            _snap.c.version >= _log.c.version,
        )
        .correlate(_log),
    )
    .order_by(_log.c.created_at_ms)
    .limit(bindparam("batch_size"))
)
_DELETE_COMMANDS: Final = delete(_log).where(_log.c.id.in_(bindparam("ids", expanding=True)))
# Rooms with rows old enough to prune that no snapshot covers (a room below snapshot_every_n versions
# is never snapshotted by its commands): a snapshot of each makes those rows prunable.
_UNCOVERED_ROOMS: Final = (
    select(_log.c.app_code, _log.c.room_id)
    .where(
        _log.c.created_at_ms < bindparam("before_ms"),
        ~exists()
        .where(
            _snap.c.app_code == _log.c.app_code,
            _snap.c.room_id == _log.c.room_id,
            _snap.c.version >= _log.c.version,
        )
        .correlate(_log),
    )
    .distinct()
    .limit(bindparam("limit"))
)


# --------------------------------------------------------------------------- store


class SqlRoomStore:
    """The room store on a :class:`Database`; keeps the newest ``snapshot_keep`` snapshots per room."""

    def __init__(self, db: Database, *, snapshot_keep: int = 2) -> None:
        if snapshot_keep < 1:
            raise ValueError("snapshot_keep must be at least 1")
        self.db = db
        self.snapshot_keep = snapshot_keep
        # rooms snapshot_uncovered could not load: passed over by its later calls (logged once each)
        self._unloadable: set[tuple[str, str]] = set()
        self._insert_snapshot = db.insert_ignoring_duplicates(room_snapshot)
        # Mutations that queue behind a commit share the next one (see store.group_commit).
        lanes, max_batch = (_SQLITE_LANES, _SQLITE_MAX_BATCH) if db.is_sqlite else (_MYSQL_LANES, _MYSQL_MAX_BATCH)
        self._group_commit: GroupCommit[_MutationUnit, None] = GroupCommit(
            self._commit_batch, lanes=lanes, max_batch=max_batch, timeout_s=db.timeout_s
        )
        self.retried_alone = 0  # batches rolled back and retried one mutation at a time
        self.guards_redone = 0  # batches rolled back for a failed guard and redone a guard a statement

    def render_ahead(self) -> None:
        """Render every shape of the shared transaction's guarded UPDATE (one per room count, 1 to
        ``_MAX_ROOMS_AN_UPDATE``) now: a server calls it at start-up, so that its first commands do
        not pay for it (see :meth:`Database.render_ahead`)."""
        sqlite = self.db.is_sqlite
        self.db.render_ahead(_guarded_updates(rooms, sqlite=sqlite) for rooms in range(1, _MAX_ROOMS_AN_UPDATE + 1))

    async def find_command(self, app_code: str, room_id: str, command_id: str) -> LoggedCommand | None:
        params = {"app_code": app_code, "room_id": room_id, "command_id": command_id}
        rows = await run_reads(self.db, _rows_of, _FIND_COMMAND, params)
        if not rows:
            return None
        command_id_, fingerprint_, response, version, command_type = rows[0]
        return LoggedCommand(command_id_, fingerprint_, orjson.loads(response), version, command_type)

    async def take_lease_epoch(self, app_code: str, room_id: str) -> int:
        return await run_writes(self.db, _take_lease_epoch, {"b_app_code": app_code, "b_room_id": room_id})

    async def load_room(self, app_code: str, room_id: str) -> LoadedRoom:
        rows = await run_reads(self.db, _rows_of, _LOAD_ROOM, {"app_code": app_code, "room_id": room_id})
        meta_version: int | None = None
        epoch = 0
        state: RoomState | None = None
        snapshot_version = next_version = 0
        events: list[Event] = []
        for kind, version, seq, doc in rows:
            if kind == _KIND_META:
                meta_version, epoch = version, seq
            elif doc is None:  # only meta rows carry no document
                continue
            elif kind == _KIND_SNAPSHOT:
                state = RoomState.from_dict(orjson.loads(doc))
                snapshot_version = next_version = version
            else:
                # every command with events takes the next version: a log row missing in the middle
                # would replay into a wrong room whose version still matches room_meta's
                next_version += 1
                if version != next_version:
                    raise StoreInconsistent(
                        f"room {app_code}/{room_id}: the command log goes from version {next_version - 1} "
                        f"to {version}; the rows between are missing"
                    )
                events.extend(Event.from_dict(data) for data in orjson.loads(doc))
        state = replay(state, events)
        loaded_version = 0 if state is None else state.version
        if loaded_version != (meta_version or 0):
            # room_meta and the log are written in one transaction; a mismatch
            # means rows recovery depends on are gone. Refuse rather than serve
            # (and later overwrite) a wrong room.
            raise StoreInconsistent(
                f"room {app_code}/{room_id}: snapshot + command log give version "
                f"{loaded_version}, room_meta says {meta_version}"
            )
        return LoadedRoom(state=state, epoch=epoch, snapshot_version=snapshot_version, replayed_events=len(events))

    async def save_mutation(self, mutation: Mutation) -> None:
        if mutation.state_after is None:
            raise ValueError("a mutation must carry the room state after the command")
        # Rows are built before the write lock is taken: the transaction only executes.
        meta_guard, meta_values = _meta_write(mutation, mutation.state_after)
        command = _command_row(mutation, mutation.state_after)
        outbox = [_outbox_row(event, mutation.now_ms, mutation.trace_context) for event in mutation.events]
        unit = (mutation, meta_guard, meta_values, command, outbox)
        await self._group_commit.save(unit)

    def group_commit_stats(self) -> dict[str, int]:
        """Shared write transactions ``save_mutation`` started, the mutations they carried, how many
        were rolled back for one mutation's failure and retried one mutation at a time, and how many
        were rolled back because a guard of their one UPDATE failed and redone an UPDATE a room."""
        gc = self._group_commit
        return {
            "transactions": gc.transactions,
            "mutations": gc.mutations,
            "retried_alone": self.retried_alone,
            "guards_redone": self.guards_redone,
        }

    async def _commit_batch(self, units: list[_MutationUnit]) -> list[Failed | None]:
        outcomes = await self._commit_units(units)
        for unit, outcome in zip(units, outcomes, strict=True):
            attached = unit[0].attached
            if attached is not None and outcome is None:
                attached.committed()
        return outcomes

    async def _commit_units(self, units: list[_MutationUnit]) -> list[Failed | None]:
        if len(units) == 1:
            return [await _outcome_of(run_writes(self.db, _save_mutation, *units[0]))]
        try:
            try:
                return await run_writes(self.db, _save_mutations_together, units, True)
            except _GuardFailed:
                # rolled back, nothing of it committed: the batch again with a guarded UPDATE per room,
                # which tells the stale rooms apart, so that they fail alone and the rest commit
                self.guards_redone += 1
                return await run_writes(self.db, _save_mutations_together, units, False)
        except _RetryAlone:
            # rolled back, nothing of it committed: each mutation again in a transaction of its own,
            # so the one that failed fails alone
            self.retried_alone += 1
            return list(
                await asyncio.gather(*(_outcome_of(run_writes(self.db, _save_mutation, *unit)) for unit in units))
            )

    async def save_snapshot(self, state: RoomState, *, now_ms: int) -> None:
        row = {
            "app_code": state.app_code,
            "room_id": state.room_id,
            "version": state.version,
            "state": dump_json(state.to_dict()),
            "created_at_ms": now_ms,
        }
        await self.db.run_write(_save_snapshot, self._insert_snapshot, row, self.snapshot_keep)

    async def list_room_summaries(self, *, limit: int) -> list[RoomSummary]:
        rows = await self.db.run_read(_all_rows, _LIST_SUMMARIES, {"limit": limit})
        return [
            RoomSummary(
                app_code=r.app_code,
                room_id=r.room_id,
                owner_id=r.owner_id,
                title=r.title,
                status=r.status,
                version=r.version,
                member_count=r.member_count,
                heat=r.heat,
                updated_at_ms=r.updated_at_ms,
            )
            for r in rows
        ]

    async def ping(self) -> None:
        await self.db.run_read(_all_rows, _PING, {})

    async def snapshot_uncovered(self, *, before_ms: int, limit: int, now_ms: int) -> int:
        """Snapshot up to ``limit`` rooms whose rows older than ``before_ms`` no snapshot covers, so
        :meth:`prune_command_log` can delete them; returns how many rooms it took up (``limit``: there
        may be more). A snapshot of the loaded (committed) state is right whatever commands run
        meanwhile. A room that does not load is logged once and passed over by later calls of this
        store (its rows stay until an operator mends it)."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        params = {"before_ms": before_ms, "limit": limit + len(self._unloadable)}
        rooms = [key for key in await self.db.run_long_read(_uncovered_rooms, params) if key not in self._unloadable]
        for app_code, room_id in rooms[:limit]:
            try:
                loaded = await self.load_room(app_code, room_id)
            except errors.Unavailable:
                raise
            except Exception as exc:  # inconsistent, undecodable
                self._unloadable.add((app_code, room_id))
                _logger.warning("command_log_snapshot_skipped", app_code=app_code, room_id=room_id, error=repr(exc))
                continue
            if loaded.state is not None:
                await self.save_snapshot(loaded.state, now_ms=now_ms)
        return min(len(rooms), limit)

    async def prune_command_log(self, *, before_ms: int, batch_size: int) -> int:
        """Delete up to ``batch_size`` idempotency rows older than ``before_ms``; returns how many.

        A row goes only when its room has a snapshot at or after its version,
        so recovery never needs a deleted row. Call repeatedly until it
        returns less than ``batch_size``.
        """
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        return await self.db.run_long_write(_prune_command_log, {"before_ms": before_ms, "batch_size": batch_size})


# --------------------------------------------------------------------------- transaction units
# Plain synchronous functions of a Connection, run by Database.run_read/run_write.


def _uncovered_rooms(conn: Connection, params: dict[str, Any]) -> list[tuple[str, str]]:
    return [(str(app_code), str(room_id)) for app_code, room_id in conn.execute(_UNCOVERED_ROOMS, params)]


def _all_rows(conn: Connection, statement: Executable, params: dict[str, Any]) -> Sequence[Row[Any]]:
    return conn.execute(statement, params).all()


async def _rows_of(reads: Writes, statement: Any, params: dict[str, Any]) -> Sequence[tuple[Any, ...]]:
    return await reads.rows(statement, params)


async def _take_lease_epoch(writes: Writes, params: dict[str, Any]) -> int:
    if await writes.execute_rendered(_BUMP_EPOCH, params) == 0:
        return 0
    rows = await writes.rows(_SELECT_EPOCH, params)
    return int(rows[0][0]) if rows else 0


async def _save_mutation(
    writes: Writes,
    m: Mutation,
    meta_guard: dict[str, Any] | None,
    meta_values: dict[str, Any],
    command: dict[str, Any],
    outbox: list[dict[str, Any]],
) -> None:
    if m.attached is not None:  # first: row locks in the global order (attached rows, then rooms)
        await m.attached.write(writes, shared=False)
    await _write_meta(writes, m, meta_guard, meta_values)
    try:
        await writes.insert_rows(_INSERT_COMMAND, [command])
    except IntegrityError as exc:
        raise CommandIdTaken(f"command_id {m.command_id!r} is already logged in {m.app_code}/{m.room_id}") from exc
    if outbox:
        # A failure here (a duplicate event_id) is a bug, not a race: let it surface.
        await writes.insert_rows(_INSERT_OUTBOX, outbox)


async def _write_meta(
    writes: Writes, m: Mutation, meta_guard: dict[str, Any] | None, meta_values: dict[str, Any]
) -> None:
    """The room_meta row of ``m``: inserted for CreateRoom, else updated under the version and epoch guard."""
    if meta_guard is None:
        try:
            await writes.insert_rows(_INSERT_META, [meta_values])
        except IntegrityError as exc:
            raise StoreConflict(f"room {m.app_code}/{m.room_id} already exists") from exc
        return
    guarded = _UPDATE_META if m.events else _TOUCH_META
    if await writes.execute_rendered(guarded, {**meta_guard, **meta_values}) != 1:
        raise StoreConflict(
            f"room {m.app_code}/{m.room_id} is no longer at version {m.expected_version} with lease epoch {m.epoch}"
        )


_MutationUnit = tuple[Mutation, "dict[str, Any] | None", "dict[str, Any]", "dict[str, Any]", "list[dict[str, Any]]"]
# SQLite: one writer, so one lane; a batch is one write lock's worth of work.
_SQLITE_LANES: Final = 1
_SQLITE_MAX_BATCH: Final = 256
# MySQL/MariaDB: a few shared transactions in flight, so one's round trips and COMMIT (its
# log flush) overlap the next one's statements and the rows being built for the one after.
# Batches of up to 32 (one guarded UPDATE): with 64 callers, 64 a batch put everyone in one
# transaction and left the other lanes idle (store 0.72x the bare driver at 64, 1.2-1.5x at
# 16-32); with a batch's guards in one UPDATE, 4 x 32 took 596-697 us of CPU a command against
# 748-812 at 4 x 16 and 661-967 at 8 x 8 or 8 x 16 (bench.command_path's service run, interleaved).
_MYSQL_LANES: Final = 4
_MYSQL_MAX_BATCH: Final = 32
# MySQL/MariaDB errors after which the server has rolled back (1213: deadlock) or can
# (1205: lock wait timeout) and the connection still answers: nothing of the batch committed.
_MYSQL_RETRY_ALONE_CODES: Final = frozenset({1205, 1213})


class _RetryAlone(Exception):
    """The shared transaction was rolled back for one mutation's sake (which, the
    database did not say): each mutation of it is retried in a transaction of its own."""


class _GuardFailed(Exception):
    """A guard of the batch's one meta UPDATE matched no row (which room's, the row count cannot
    say): the transaction is rolled back and the batch redone with a guarded UPDATE per room."""


async def _save_mutations_together(
    writes: Writes, units: list[_MutationUnit], guards_together: bool
) -> list[Failed | None]:
    """The shared transaction, without a SAVEPOINT per mutation: the attached writes (gift
    debits), the meta writes, then every command log row in one INSERT and every outbox row
    in another.

    The meta writes: with ``guards_together``, the guarded updates of every mutation with events
    go in one UPDATE (up to ``_MAX_ROOMS_AN_UPDATE`` rooms a statement: one round trip instead of
    one a room on MySQL/MariaDB); if it matches fewer rows than rooms, :class:`_GuardFailed`.
    Creations, no-op touches, and every guard without ``guards_together``, are a statement each.

    An attached write that fails having written nothing (an insufficient balance), a guard
    that matches no row (stale version or epoch) in a statement of its own, or a room that
    already exists wrote nothing (both backends roll back the failed statement only): that
    mutation fails alone and its rows are left out. A failure that cannot be pinned on one
    mutation (a reused command_id in the shared INSERT, a deadlock), an attached write that
    needs its own transaction, or a guard that fails after its mutation's attached write was
    written raises :class:`_RetryAlone`.
    """
    outcomes: list[Failed | None] = [None] * len(units)
    # row locks in one global order, so that two batches (of two processes) never wait for each
    # other crosswise: the attached writes' rows (wallet accounts) in their order, then the rooms
    # (those updated together in key order, then the others in key order)
    attached = sorted(
        ((unit[0].attached, i) for i, unit in enumerate(units) if unit[0].attached is not None),
        key=lambda pair: pair[0].lock_order,
    )
    order = sorted(range(len(units)), key=lambda i: (units[i][0].app_code, units[i][0].room_id))
    try:
        for write, i in attached:
            try:
                await write.write(writes, shared=True)
            except NeedsOwnTransaction as exc:
                raise _RetryAlone("an attached write needs a transaction of its own") from exc
            except errors.RoomServiceError as failure:  # it wrote nothing: its mutation fails alone
                outcomes[i] = Failed(failure)
        together = [i for i in order if outcomes[i] is None and units[i][1] is not None and units[i][0].events]
        if not guards_together or len(together) < 2:
            together = []
        await _update_guarded_together(writes, [units[i] for i in together])
        alone = set(together)
        for i in order:
            if outcomes[i] is not None or i in alone:
                continue
            m, meta_guard, meta_values, _, _ = units[i]
            try:
                await _write_meta(writes, m, meta_guard, meta_values)
            except StoreConflict as conflict:
                if m.attached is not None:  # its attached write stands in this transaction: undo it all
                    raise _RetryAlone("a room's guard failed after its attached write") from conflict
                outcomes[i] = Failed(conflict)
        commands = [units[i][3] for i in order if outcomes[i] is None]
        outbox = [row for i in order if outcomes[i] is None for row in units[i][4]]
        if commands:
            await writes.insert_rows(_INSERT_COMMAND, commands)
        if outbox:
            await writes.insert_rows(_INSERT_OUTBOX, outbox)
    except IntegrityError as exc:
        raise _RetryAlone("a row of the shared INSERT clashed") from exc
    except OperationalError as exc:
        if _mysql_error_code(exc) in _MYSQL_RETRY_ALONE_CODES:
            raise _RetryAlone(f"shared transaction rolled back ({_mysql_error_code(exc)})") from exc
        raise
    return outcomes


async def _update_guarded_together(writes: Writes, units: list[_MutationUnit]) -> None:
    """The guarded meta updates of ``units`` (all with events), ``_MAX_ROOMS_AN_UPDATE`` rooms a
    statement; :class:`_GuardFailed` unless every guard matched its row."""
    for start in range(0, len(units), _MAX_ROOMS_AN_UPDATE):
        chunk = units[start : start + _MAX_ROOMS_AN_UPDATE]
        params: dict[str, Any] = {}
        for i, (_, meta_guard, meta_values, _, _) in enumerate(chunk):
            assert meta_guard is not None
            for key, value in meta_guard.items():
                params[f"{key}{i}"] = value
            for key, value in meta_values.items():
                params[f"{key}{i}"] = value
        statement = _guarded_updates(len(chunk), sqlite=writes.dialect.name == "sqlite")
        if await writes.execute_rendered(statement, params) != len(chunk):
            raise _GuardFailed(f"{len(chunk)} guarded rooms, not all of them at their version and lease epoch")


async def _outcome_of(write: Awaitable[None]) -> Failed | None:
    """None when ``write`` committed, else the exception it failed with."""
    try:
        await write
    except Exception as failure:
        return Failed(failure)
    return None


def _mysql_error_code(exc: OperationalError) -> int | None:
    args = getattr(exc.orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _save_snapshot(conn: Connection, insert_ignoring_duplicates: Insert, row: dict[str, Any], keep: int) -> None:
    conn.execute(insert_ignoring_duplicates, row)
    room = {"app_code": row["app_code"], "room_id": row["room_id"]}
    oldest_kept = conn.scalar(_NTH_NEWEST_SNAPSHOT, {**room, "skip": keep - 1})
    if oldest_kept is not None:
        conn.execute(_DELETE_OLD_SNAPSHOTS, {**room, "below_version": oldest_kept})


def _prune_command_log(conn: Connection, params: dict[str, Any]) -> int:
    ids = list(conn.scalars(_PRUNABLE_COMMANDS, params))
    if not ids:
        return 0
    return conn.execute(_DELETE_COMMANDS, {"ids": ids}).rowcount


# --------------------------------------------------------------------------- rows


def _meta_write(m: Mutation, state: RoomState) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(guard params, values): no guard and a full row for CreateRoom, else the guarded update's."""
    if m.expected_version == 0:
        return None, _meta_row(m, state)
    guard = {
        "b_app_code": m.app_code,
        "b_room_id": m.room_id,
        "b_expected_version": m.expected_version,
        "b_epoch": m.epoch,
    }
    return guard, (_meta_changes(m, state) if m.events else {})


def _meta_row(m: Mutation, state: RoomState) -> dict[str, Any]:
    return {
        "app_code": m.app_code,
        "room_id": m.room_id,
        "version": state.version,
        "lease_epoch": m.epoch,
        "owner_id": state.owner_id,
        "title": state.title,
        "status": state.status,
        "seat_count": state.seat_count,
        "member_count": len(state.members),
        "heat": state.heat,
        "created_at_ms": m.now_ms,
        "updated_at_ms": m.now_ms,
    }


def _meta_changes(m: Mutation, state: RoomState) -> dict[str, Any]:
    return {
        "version": state.version,
        "status": state.status,
        "title": state.title,
        "member_count": len(state.members),
        "heat": state.heat,
        "updated_at_ms": m.now_ms,
    }


def _command_row(m: Mutation, state: RoomState) -> dict[str, Any]:
    return {
        "app_code": m.app_code,
        "room_id": m.room_id,
        "command_id": m.command_id,
        "command_type": m.command_type,
        "fingerprint": m.fingerprint,
        "command": dump_json(m.command),
        "events": dump_json([event.to_dict() for event in m.events]),
        # the answer's own encoding (the HTTP fast path sends the same bytes): no second encoding
        "response": m.response.encoded.decode() if isinstance(m.response, Answer) else dump_json(m.response),
        "version": state.version,
        "now_ms": m.now_ms,
        "created_at_ms": m.now_ms,
        "timing": None if m.timing is None else dump_json(m.timing),
    }


def _outbox_row(event: Event, now_ms: int, trace_context: str | None = None) -> dict[str, Any]:
    return {
        "event_id": event.event_id,
        "app_code": event.app_code,
        "room_id": event.room_id,
        "room_version": event.room_version,
        "event_type": event.type,
        "payload": wire.encode_event(event),
        "status": OUTBOX_PENDING,
        "targets_done": "",
        "due_at_ms": now_ms,
        "created_at_ms": now_ms,
        "updated_at_ms": now_ms,
        "trace_context": trace_context,
    }
