"""Contract suite of the RoomStore port, run on SQLite and MariaDB through the ``database`` fixture.

Rooms are driven through the real domain (``decide`` -> ``stamp`` ->
``replay``), so what the store keeps is what the Room Cell would commit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from roomservice import wire
from roomservice.domain import commands as c
from roomservice.domain.decider import decide, replay, stamp
from roomservice.domain.rules import Gift, RoomRules
from roomservice.domain.state import RoomState
from roomservice.store import driver as store_driver
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.store.migrate import current_revision, head_revision, upgrade
from roomservice.store.port import CommandIdTaken, Mutation, StoreConflict, StoreInconsistent, StoreUnavailable
from roomservice.store.sql import SqlRoomStore

APP = "app_1"
ROOM = "room-1"
OWNER = "owner"
T0 = 1_780_000_000_000  # mid-day UTC, far from the treasure reset
RULES = RoomRules(
    gifts={"rose": Gift("rose", "Rose", 10), "rocket": Gift("rocket", "Rocket", 1000)},
    treasure_levels=(1000, 5000, 20000),
)

_event_ids = (f"evt-{n:08d}" for n in itertools.count())


def fingerprint(command: c.Command) -> str:
    return hashlib.sha256(json.dumps(command.to_dict(), sort_keys=True).encode()).hexdigest()


@dataclass
class RoomDriver:
    """A room as one Room Cell sees it: decides, builds the Mutation, applies it after commit."""

    store: SqlRoomStore
    app_code: str = APP
    room_id: str = ROOM
    epoch: int = 1
    now_ms: int = T0
    state: RoomState | None = None
    command_ids: Iterator[int] = field(default_factory=itertools.count)

    def mutation(self, command: c.Command, *, command_id: str | None = None) -> Mutation:
        self.now_ms += 1_000
        payloads = decide(self.state, command, now_ms=self.now_ms, rules=RULES)
        events = stamp(
            payloads,
            state=self.state,
            app_code=self.app_code,
            room_id=self.room_id,
            now_ms=self.now_ms,
            new_event_id=lambda: next(_event_ids),
        )
        after = replay(self.state, events)
        assert after is not None
        return Mutation(
            app_code=self.app_code,
            room_id=self.room_id,
            command_id=command_id or f"cmd-{next(self.command_ids)}",
            command_type=command.name,
            fingerprint=fingerprint(command),
            command=command.to_dict(),
            events=tuple(events),
            response={
                "version": after.version,
                "events": [{"event_id": ev.event_id, "type": ev.type} for ev in events],
                "title": after.title,
            },
            now_ms=self.now_ms,
            expected_version=0 if self.state is None else self.state.version,
            epoch=self.epoch,
            state_after=after,
        )

    async def run(self, command: c.Command, *, command_id: str | None = None) -> Mutation:
        m = self.mutation(command, command_id=command_id)
        await self.store.save_mutation(m)
        self.state = m.state_after
        return m

    async def create(self, *, title: str = "Friday night", seat_count: int = 8) -> Mutation:
        return await self.run(c.CreateRoom(owner_id=OWNER, title=title, seat_count=seat_count))


@pytest.fixture
def store(database: Database) -> SqlRoomStore:
    return SqlRoomStore(database, snapshot_keep=2)


@pytest.fixture
def room(store: SqlRoomStore) -> RoomDriver:
    return RoomDriver(store)


async def count(db: Database, table: sa.Table, *where: Any) -> int:
    async with db.read() as conn:
        return int(await conn.scalar(sa.select(sa.func.count()).select_from(table).where(*where)) or 0)


async def meta_row(db: Database, app_code: str = APP, room_id: str = ROOM) -> Any:
    async with db.read() as conn:
        m = t.room_meta.c
        return (await conn.execute(sa.select(t.room_meta).where(m.app_code == app_code, m.room_id == room_id))).first()


async def written_rows(db: Database) -> tuple[int, int, int, int]:
    """(command log rows, outbox rows, snapshot rows, room meta version) of the default room."""
    meta = await meta_row(db)
    return (
        await count(db, t.room_command_log),
        await count(db, t.room_outbox),
        await count(db, t.room_snapshot),
        -1 if meta is None else meta.version,
    )


# --------------------------------------------------------------------------- migrations


async def test_upgrade_creates_schema_and_is_a_noop_the_second_time(empty_backend_url: str) -> None:
    db = Database.from_url(empty_backend_url)
    try:
        assert await current_revision(db) is None
        await upgrade(db)
        assert await current_revision(db) == head_revision() == "0006"
        async with db.write() as conn:
            await conn.execute(
                sa.insert(t.wallet_account).values(app_code=APP, user_id="u", balance=5, updated_at_ms=1)
            )

        await upgrade(db)  # again: nothing to do, nothing lost

        assert await current_revision(db) == head_revision()
        assert await count(db, t.wallet_account) == 1

        def inspect(conn: sa.Connection) -> tuple[set[str], list[Any]]:
            names = set(sa.inspect(conn).get_table_names())
            return names, compare_metadata(MigrationContext.configure(conn), t.metadata)

        async with db.read() as conn:
            names, drift = await conn.run_sync(inspect)
        assert set(t.metadata.tables) <= names
        assert drift == [], f"tables.py and the migrations disagree: {drift}"
    finally:
        await db.dispose()


# --------------------------------------------------------------------------- save_mutation


async def test_create_room_writes_meta_log_and_outbox(database: Database, room: RoomDriver) -> None:
    m = await room.create(title="Karaoke 🎤 夜", seat_count=6)

    meta = await meta_row(database)
    assert (meta.version, meta.lease_epoch, meta.owner_id, meta.title, meta.status) == (
        1,
        1,
        OWNER,
        "Karaoke 🎤 夜",
        "open",
    )
    assert (meta.seat_count, meta.member_count, meta.heat) == (6, 1, 0)
    assert meta.created_at_ms == meta.updated_at_ms == m.now_ms
    logged = await room.store.find_command(APP, ROOM, m.command_id)
    assert logged is not None
    assert logged.version == 1
    assert logged.response["title"] == "Karaoke 🎤 夜"
    assert await count(database, t.room_outbox) == 1


async def test_outbox_rows_carry_columns_status_and_decodable_payload(database: Database, room: RoomDriver) -> None:
    await room.create()
    await room.run(c.JoinRoom(user_id="alice"))
    await room.run(c.TakeMic(user_id="alice", seat=2))
    m = await room.run(c.TakeMic(user_id="alice", seat=5))  # moves: RoomMicLeft + RoomMicTaken
    assert [ev.type for ev in m.events] == ["RoomMicLeft", "RoomMicTaken"]

    o = t.room_outbox.c
    async with database.read() as conn:
        rows = (await conn.execute(sa.select(t.room_outbox).where(o.room_version == 4).order_by(o.id))).all()
    assert [r.event_id for r in rows] == [ev.event_id for ev in m.events]
    for row, event in zip(rows, m.events, strict=True):
        assert (row.app_code, row.room_id, row.room_version, row.event_type) == (APP, ROOM, 4, event.type)
        assert row.status == "pending"
        assert (row.retry_count, row.replay_count, row.targets_done) == (0, 0, "")
        assert row.due_at_ms == row.created_at_ms == row.updated_at_ms == m.now_ms
        assert {row.next_retry_at_ms, row.lock_until_ms, row.lock_owner, row.delivered_at_ms} == {None}
        assert isinstance(row.payload, bytes)
        assert wire.decode_event(row.payload) == event
    assert await count(database, t.room_outbox) == 5


async def test_failed_outbox_insert_leaves_nothing_behind(database: Database, room: RoomDriver) -> None:
    await room.create()
    before = await written_rows(database)
    m = room.mutation(c.JoinRoom(user_id="alice"))
    clash = replace(m.events[0], event_id="evt-taken")
    async with database.write() as conn:  # some other row already holds that event_id
        await conn.execute(
            sa.insert(t.room_outbox).values(
                event_id="evt-taken",
                app_code=APP,
                room_id="other",
                room_version=1,
                event_type="RoomCreated",
                payload=b"x",
                status="delivered",
                due_at_ms=1,
                created_at_ms=1,
                updated_at_ms=1,
            )
        )

    with pytest.raises(sa.exc.IntegrityError):
        await room.store.save_mutation(replace(m, events=(clash,)))

    # the meta update and the command log insert ran before the failing insert; both are gone
    assert await written_rows(database) == (before[0], before[1] + 1, before[2], 1)
    assert await room.store.find_command(APP, ROOM, m.command_id) is None
    await room.store.save_mutation(m)  # and the same command commits cleanly afterwards
    assert (await meta_row(database)).version == 2


async def test_stale_expected_version_is_rejected_with_nothing_written(database: Database, room: RoomDriver) -> None:
    await room.create()
    stale = room.mutation(c.JoinRoom(user_id="alice"))
    await room.run(c.JoinRoom(user_id="bob"))  # the room moves on to version 2
    before = await written_rows(database)

    with pytest.raises(StoreConflict) as raised:
        await room.store.save_mutation(stale)

    assert not isinstance(raised.value, CommandIdTaken)
    assert await written_rows(database) == before
    assert await room.store.find_command(APP, ROOM, stale.command_id) is None


async def test_stale_lease_epoch_is_fenced_off(database: Database, room: RoomDriver) -> None:
    await room.create()
    assert await room.store.take_lease_epoch(APP, ROOM) == 2  # another process takes the lease
    before = await written_rows(database)

    with pytest.raises(StoreConflict):
        await room.run(c.JoinRoom(user_id="alice"))  # still on epoch 1
    with pytest.raises(StoreConflict):
        await room.run(c.JoinRoom(user_id=OWNER))  # a no-op is fenced off too

    assert await written_rows(database) == before
    room.epoch = 2
    await room.run(c.JoinRoom(user_id="alice"))
    assert (await meta_row(database)).version == 2


async def test_take_lease_epoch_is_durable_and_zero_for_unknown_rooms(store: SqlRoomStore, room: RoomDriver) -> None:
    assert await store.take_lease_epoch(APP, ROOM) == 0
    room.epoch = 7
    await room.create()
    assert [await store.take_lease_epoch(APP, ROOM) for _ in range(3)] == [8, 9, 10]
    assert (await store.load_room(APP, ROOM)).epoch == 10


async def test_reused_command_id_raises_command_id_taken_with_nothing_written(
    database: Database, room: RoomDriver
) -> None:
    await room.create()
    await room.run(c.JoinRoom(user_id="alice"), command_id="dup")
    before = await written_rows(database)

    with pytest.raises(CommandIdTaken):
        await room.store.save_mutation(room.mutation(c.JoinRoom(user_id="bob"), command_id="dup"))

    # the guarded meta update succeeded before the log insert failed: rolled back too
    assert await written_rows(database) == before
    logged = await room.store.find_command(APP, ROOM, "dup")
    assert logged is not None
    assert logged.fingerprint == fingerprint(c.JoinRoom(user_id="alice"))


async def test_creating_an_existing_room_conflicts(database: Database, room: RoomDriver) -> None:
    await room.create()
    before = await written_rows(database)
    rival = RoomDriver(room.store)

    with pytest.raises(StoreConflict):
        await rival.create(title="rival")

    assert await written_rows(database) == before
    assert (await meta_row(database)).title == "Friday night"


async def test_noop_command_is_logged_without_a_version_bump(database: Database, room: RoomDriver) -> None:
    await room.create()
    await room.run(c.JoinRoom(user_id="alice"))
    outbox_before = await count(database, t.room_outbox)
    meta_before = await meta_row(database)
    room.now_ms -= 1_000  # same decision time as the last command: the meta row is rewritten identically

    m = await room.run(c.JoinRoom(user_id="alice"), command_id="again")

    assert m.events == ()
    assert m.now_ms == meta_before.updated_at_ms
    logged = await room.store.find_command(APP, ROOM, "again")
    assert logged is not None
    assert logged.version == 2
    assert await meta_row(database) == meta_before
    assert await count(database, t.room_outbox) == outbox_before
    loaded = await room.store.load_room(APP, ROOM)
    assert loaded.state == room.state
    assert loaded.replayed_events == 2  # the no-op contributes nothing to replay


async def test_noop_guard_matches_unchanged_rows_on_mysql(database: Database, room: RoomDriver) -> None:
    """MySQL counts changed rows unless CLIENT.FOUND_ROWS is set; the guard needs matched rows."""
    await room.create()
    for n in range(3):
        await room.run(c.LeaveMic(user_id=OWNER), command_id=f"noop-{n}")  # nothing changes, 3 times
    assert await count(database, t.room_command_log) == 4
    if database.dialect_name == "mysql":
        async with database.write() as conn:
            m = t.room_meta.c
            same = await conn.execute(
                sa.update(t.room_meta).where(m.app_code == APP, m.room_id == ROOM).values(version=1)
            )
        assert same.rowcount == 1


# --------------------------------------------------------------------------- recovery


async def _drive(room: RoomDriver, *, until_version: int, snapshot_every: int | None) -> None:
    """A busy room (joins, leaves, mics, gifts, treasure boxes opening, kicks, no-ops) up to a version."""
    await room.create(seat_count=4)
    users = [f"user{n}" for n in range(6)]
    for step in itertools.count():
        if room.state is None or room.state.version >= until_version:
            break
        assert step < until_version * 3, "the scenario stopped making progress"
        user = users[step % len(users)]
        state = room.state
        assert state is not None
        box = state.treasure.box
        members = [u for u in state.members if u != OWNER]
        seat = step % 4
        command: c.Command
        if box is not None and room.now_ms + 1_000 >= box.open_at_ms:
            command = c.OpenTreasure(box_id=box.box_id, level=box.level, open_at_ms=box.open_at_ms)
        elif step % 7 in (0, 1):
            command = c.JoinRoom(user) if state.banned_until(user, room.now_ms + 1_000) is None else c.LeaveRoom(user)
        elif step % 7 == 2:
            free = state.is_member(user) and state.seats[seat] in (None, user)
            command = c.TakeMic(user_id=user, seat=seat) if free else c.LeaveMic(user)
        elif step % 7 == 3 and members:
            command = c.SendGift(sender_id=OWNER, receiver_id=members[0], gift_id="rocket", count=1)
        elif step % 7 == 4:
            command = c.LeaveRoom(user_id=user)
        elif step % 7 == 5:
            command = c.SendGift(sender_id=OWNER, receiver_id=OWNER, gift_id="rose", count=7)
        elif step % 7 == 6 and state.is_member(user):
            command = c.KickUser(operator_id=OWNER, target_id=user, ban_seconds=1)
        else:
            command = c.LeaveMic(user_id=user)
        await room.run(command)
        if snapshot_every and room.state is not None and room.state.version % snapshot_every == 0:
            await room.store.save_snapshot(room.state, now_ms=room.now_ms)


async def test_snapshot_plus_log_replay_recovers_the_live_state(store: SqlRoomStore, room: RoomDriver) -> None:
    await _drive(room, until_version=120, snapshot_every=50)
    live = room.state
    assert live is not None
    assert live.version > 100
    assert live.heat > 0
    assert live.treasure.opened >= 1  # boxes opened along the way (tuples of recipients in the log)

    loaded = await store.load_room(APP, ROOM)

    assert loaded.state is not None
    assert loaded.state.to_dict() == live.to_dict()
    assert loaded.snapshot_version == 100
    assert loaded.replayed_events > 0
    assert loaded.epoch == 1


async def test_without_a_snapshot_load_replays_the_whole_log(store: SqlRoomStore, room: RoomDriver) -> None:
    await _drive(room, until_version=40, snapshot_every=None)

    loaded = await store.load_room(APP, ROOM)

    assert loaded.snapshot_version == 0
    assert loaded.state == room.state
    async with store.db.read() as conn:
        events = await conn.scalars(sa.select(t.room_command_log.c.events))
        assert loaded.replayed_events == sum(len(json.loads(doc)) for doc in events)


async def test_load_of_an_unknown_room_is_empty(store: SqlRoomStore, room: RoomDriver) -> None:
    await room.create()
    loaded = await store.load_room(APP, "nope")
    assert (loaded.state, loaded.epoch, loaded.snapshot_version, loaded.replayed_events) == (None, 0, 0, 0)


async def test_load_refuses_a_room_whose_log_is_missing_rows(database: Database, room: RoomDriver) -> None:
    await room.create()
    m = await room.run(c.JoinRoom(user_id="alice"))
    async with database.write() as conn:
        await conn.execute(sa.delete(t.room_command_log).where(t.room_command_log.c.command_id == m.command_id))
    with pytest.raises(StoreInconsistent, match="room_meta says 2"):
        await room.store.load_room(APP, ROOM)


@pytest.mark.parametrize("snapshot", [False, True])
async def test_load_refuses_a_room_whose_log_misses_a_row_in_the_middle(
    database: Database, room: RoomDriver, snapshot: bool
) -> None:
    """The version still matches room_meta: only the versions' sequence shows that a command is missing."""
    await room.create()
    await room.run(c.JoinRoom(user_id="alice"))
    if snapshot:
        assert room.state is not None
        await room.store.save_snapshot(room.state, now_ms=room.now_ms)  # version 2
    middle = await room.run(c.JoinRoom(user_id="bob"))
    await room.run(c.LeaveRoom(user_id="carol"))  # a no-op: logged with no events, no version of its own
    await room.run(c.JoinRoom(user_id="dan"))
    assert (await room.store.load_room(APP, ROOM)).state == room.state  # whole, it loads
    async with database.write() as conn:
        await conn.execute(sa.delete(t.room_command_log).where(t.room_command_log.c.command_id == middle.command_id))
    with pytest.raises(StoreInconsistent, match="from version 2 to 4"):
        await room.store.load_room(APP, ROOM)


async def test_snapshots_are_idempotent_and_pruned_to_snapshot_keep(database: Database, room: RoomDriver) -> None:
    await room.create()
    saved: list[int] = []
    for n in range(5):
        await room.run(c.JoinRoom(user_id=f"u{n}"))
        assert room.state is not None
        await room.store.save_snapshot(room.state, now_ms=room.now_ms)
        await room.store.save_snapshot(room.state, now_ms=room.now_ms + 5)  # same version again: ignored
        saved.append(room.state.version)

    async with database.read() as conn:
        s = t.room_snapshot.c
        kept = (await conn.execute(sa.select(s.version, s.created_at_ms).order_by(s.version))).all()
    assert [v for v, _ in kept] == saved[-2:]
    assert all(created == room.now_ms for _, created in kept[-1:])  # the first write of a version wins
    loaded = await room.store.load_room(APP, ROOM)
    assert (loaded.snapshot_version, loaded.replayed_events, loaded.state) == (saved[-1], 0, room.state)


async def test_snapshot_keep_is_per_store(database: Database, room: RoomDriver) -> None:
    keep_three = SqlRoomStore(database, snapshot_keep=3)
    room.store = keep_three
    await room.create()
    for n in range(6):
        await room.run(c.JoinRoom(user_id=f"u{n}"))
        assert room.state is not None
        await keep_three.save_snapshot(room.state, now_ms=room.now_ms)
    assert await count(database, t.room_snapshot) == 3
    with pytest.raises(ValueError, match="snapshot_keep"):
        SqlRoomStore(database, snapshot_keep=0)


# --------------------------------------------------------------------------- lookups


async def test_find_command_returns_the_stored_response(store: SqlRoomStore, room: RoomDriver) -> None:
    await room.create()
    m = await room.run(c.SendGift(sender_id=OWNER, receiver_id=OWNER, gift_id="rocket", count=1), command_id="gift-1")

    logged = await store.find_command(APP, ROOM, "gift-1")

    assert logged is not None
    assert (logged.command_id, logged.fingerprint, logged.version) == ("gift-1", m.fingerprint, 2)
    assert logged.response == m.response
    assert [ev["type"] for ev in logged.response["events"]] == ["RoomGiftSent", "RoomTreasureCountdownStarted"]
    assert await store.find_command(APP, ROOM, "gift-2") is None
    assert await store.find_command(APP, "room-2", "gift-1") is None


async def test_ids_are_case_sensitive(database: Database, store: SqlRoomStore) -> None:
    upper, lower = RoomDriver(store, room_id="Room1"), RoomDriver(store, room_id="room1")
    await upper.create(title="upper")
    await lower.create(title="lower")  # not a duplicate of "Room1"
    await upper.run(c.JoinRoom(user_id="Alice"), command_id="Cmd")
    await upper.run(c.JoinRoom(user_id="alice"), command_id="cmd")  # neither user nor command_id collide

    assert (await store.load_room(APP, "Room1")).state == upper.state
    assert (await store.load_room(APP, "room1")).state == lower.state
    assert upper.state is not None
    assert list(upper.state.members) == [OWNER, "Alice", "alice"]
    cmd, big_cmd = await store.find_command(APP, "Room1", "cmd"), await store.find_command(APP, "Room1", "Cmd")
    assert cmd is not None
    assert big_cmd is not None
    assert (big_cmd.version, cmd.version) == (2, 3)
    assert await store.find_command(APP, "ROOM1", "cmd") is None


async def test_list_room_summaries_newest_first(store: SqlRoomStore) -> None:
    rooms = [RoomDriver(store, room_id=f"r{n}", now_ms=T0 + n * 10_000) for n in range(3)]
    for r in rooms:
        await r.create(title=f"title {r.room_id}")
    rooms[0].now_ms = T0 + 100_000
    await rooms[0].run(c.JoinRoom(user_id="alice"))  # r0 is now the most recently updated

    summaries = await store.list_room_summaries(limit=2)

    assert [(s.room_id, s.version, s.member_count) for s in summaries] == [("r0", 2, 2), ("r2", 1, 1)]
    assert summaries[0].updated_at_ms == T0 + 101_000
    everything = await store.list_room_summaries(limit=10)
    assert [s.room_id for s in everything] == ["r0", "r2", "r1"]
    r2 = everything[1]
    assert (r2.app_code, r2.owner_id, r2.title, r2.status, r2.heat) == (APP, OWNER, "title r2", "open", 0)
    # closed rooms are not listed: a limit spent on them dropped open rooms from a projection rebuild
    rooms[2].now_ms = T0 + 200_000
    await rooms[2].run(c.CloseRoom(operator_id=OWNER))
    assert [s.room_id for s in await store.list_room_summaries(limit=2)] == ["r0", "r1"]


async def test_ping(store: SqlRoomStore) -> None:
    await store.ping()


# --------------------------------------------------------------------------- retention


async def test_prune_command_log_only_deletes_rows_a_snapshot_covers(database: Database, room: RoomDriver) -> None:
    await room.create()
    for n in range(5):
        await room.run(c.JoinRoom(user_id=f"u{n}"))  # versions 2..6
    assert room.state is not None
    snapshot_at = room.state.with_()  # version 6
    await room.store.save_snapshot(snapshot_at, now_ms=room.now_ms)
    await room.run(c.JoinRoom(user_id="u0"), command_id="noop-at-6")  # version 6, covered
    for n in range(5, 8):
        await room.run(c.JoinRoom(user_id=f"u{n}"))  # versions 7..9, not covered
    everything_is_old = room.now_ms + 1

    first = await room.store.prune_command_log(before_ms=everything_is_old, batch_size=4)
    second = await room.store.prune_command_log(before_ms=everything_is_old, batch_size=4)
    third = await room.store.prune_command_log(before_ms=everything_is_old, batch_size=4)

    assert (first, second, third) == (4, 3, 0)
    async with database.read() as conn:
        left = await conn.scalars(sa.select(t.room_command_log.c.version).order_by(t.room_command_log.c.version))
        assert list(left) == [7, 8, 9]
    assert await room.store.find_command(APP, ROOM, "noop-at-6") is None
    loaded = await room.store.load_room(APP, ROOM)
    assert loaded.state == room.state
    assert loaded.snapshot_version == 6


async def test_prune_command_log_respects_the_age_cutoff(database: Database, room: RoomDriver) -> None:
    await room.create()
    for n in range(4):
        await room.run(c.JoinRoom(user_id=f"u{n}"))
    assert room.state is not None
    await room.store.save_snapshot(room.state, now_ms=room.now_ms)
    cutoff = T0 + 3_000  # the rows of the first two commands are older

    assert await room.store.prune_command_log(before_ms=cutoff, batch_size=100) == 2
    assert await count(database, t.room_command_log) == 3
    other_room = RoomDriver(room.store, room_id="no-snapshot")
    await other_room.create()
    assert await room.store.prune_command_log(before_ms=T0 + 1_000_000, batch_size=100) == 3
    assert await count(database, t.room_command_log) == 1  # the room without a snapshot keeps its log


async def test_a_room_too_quiet_for_a_snapshot_is_snapshotted_so_its_old_rows_can_go(
    database: Database, room: RoomDriver
) -> None:
    """snapshot_every_n (50) is never reached by a quiet room: without a snapshot of its own, its old rows
    would stay for good and every prune batch would scan them again."""
    await room.create()
    await room.run(c.JoinRoom(user_id="u0"))
    await room.run(c.JoinRoom(user_id="u0"), command_id="noop")  # a no-op at version 2: covered too
    covered = RoomDriver(room.store, room_id="covered")
    await covered.create()
    assert covered.state is not None
    await room.store.save_snapshot(covered.state, now_ms=covered.now_ms)
    cutoff = room.now_ms + 1
    later = RoomDriver(room.store, room_id="new", now_ms=cutoff)
    await later.create()  # its rows are not old enough yet

    assert await room.store.prune_command_log(before_ms=cutoff, batch_size=100) == 1  # only "covered"'s row
    assert await room.store.snapshot_uncovered(before_ms=cutoff, limit=100, now_ms=cutoff) == 1  # ROOM only
    assert await room.store.snapshot_uncovered(before_ms=cutoff, limit=100, now_ms=cutoff) == 0
    assert await room.store.prune_command_log(before_ms=cutoff, batch_size=100) == 3
    async with database.read() as conn:
        left = (await conn.execute(sa.select(t.room_command_log.c.room_id))).scalars().all()
    assert left == ["new"]
    loaded = await room.store.load_room(APP, ROOM)
    assert (loaded.state, loaded.snapshot_version) == (room.state, 2)


async def test_snapshot_uncovered_is_bounded_and_skips_a_room_that_does_not_load(
    database: Database, room: RoomDriver
) -> None:
    rooms = [RoomDriver(room.store, room_id=f"r{n}") for n in range(3)]
    for r in rooms:
        await r.create()
        await r.run(c.JoinRoom(user_id="u"))
    async with database.write() as conn:  # r0's meta says a version its log cannot give
        await conn.execute(
            sa.update(t.room_meta).where(t.room_meta.c.room_id == "r0").values(version=t.room_meta.c.version + 5)
        )
    cutoff = max(r.now_ms for r in rooms) + 1
    first = await room.store.snapshot_uncovered(before_ms=cutoff, limit=2, now_ms=cutoff)
    second = await room.store.snapshot_uncovered(before_ms=cutoff, limit=2, now_ms=cutoff)
    third = await room.store.snapshot_uncovered(before_ms=cutoff, limit=2, now_ms=cutoff)
    assert (first, third) == (2, 0)  # r0, once tried, is passed over: it does not hold up the others
    assert second in (1, 0)  # 1 unless the first took up r1 and r2
    async with database.read() as conn:
        snapshotted = sorted((await conn.execute(sa.select(t.room_snapshot.c.room_id))).scalars().all())
    assert snapshotted == ["r1", "r2"]


# --------------------------------------------------------------------------- concurrency


async def test_concurrent_writers_in_one_process_do_not_fail(database: Database, store: SqlRoomStore) -> None:
    """On SQLite, write transactions queue on the lock instead of failing with SQLITE_BUSY."""
    rooms = [RoomDriver(store, room_id=f"c{n}") for n in range(12)]

    async def busy(r: RoomDriver) -> None:
        await r.create()
        for n in range(5):
            await r.run(c.JoinRoom(user_id=f"u{n}"))
            await store.load_room(APP, r.room_id)

    await asyncio.gather(*(busy(r) for r in rooms))

    assert await count(database, t.room_command_log) == 12 * 6
    assert {(await store.load_room(APP, r.room_id)).state == r.state for r in rooms} == {True}


async def test_racing_cells_on_one_room_commit_exactly_once(database: Database, store: SqlRoomStore) -> None:
    owner = RoomDriver(store)
    await owner.create()
    rivals = [RoomDriver(store, state=owner.state, now_ms=owner.now_ms) for _ in range(6)]
    mutations = [r.mutation(c.JoinRoom(user_id=f"u{n}"), command_id=f"race-{n}") for n, r in enumerate(rivals)]

    results = await asyncio.gather(*(store.save_mutation(m) for m in mutations), return_exceptions=True)

    assert sum(r is None for r in results) == 1
    assert all(type(r) is StoreConflict for r in results if r is not None)
    assert (await meta_row(database)).version == 2
    assert await count(database, t.room_command_log) == 2


async def test_concurrent_mutations_fail_or_commit_each_on_its_own(database: Database, store: SqlRoomStore) -> None:
    """Saved together (one shared transaction on both backends): a stale writer and a reused
    command_id fail alone; the rest commit."""
    good = [RoomDriver(store, room_id=f"g{n}") for n in range(4)]
    stale, reused = RoomDriver(store, room_id="stale"), RoomDriver(store, room_id="reused")
    for r in (*good, stale, reused):
        await r.create()
    await store.take_lease_epoch(APP, "stale")  # another process fenced this cell off
    await reused.run(c.JoinRoom(user_id="first"), command_id="dup")
    before = await written_rows(database)
    mutations = [
        *(r.mutation(c.JoinRoom(user_id="bob")) for r in good),
        stale.mutation(c.JoinRoom(user_id="bob")),
        reused.mutation(c.JoinRoom(user_id="second"), command_id="dup"),
    ]

    results = await asyncio.gather(*(store.save_mutation(m) for m in mutations), return_exceptions=True)

    assert results[:4] == [None] * 4
    assert type(results[4]) is StoreConflict
    assert type(results[5]) is CommandIdTaken
    log, outbox, _, _ = await written_rows(database)
    assert (log, outbox) == (before[0] + 4, before[1] + 4)  # exactly the four good ones
    for r in good:
        assert (await store.load_room(APP, r.room_id)).state.version == 2  # type: ignore[union-attr]
    assert (await meta_row(database, room_id="reused")).version == 2  # "first", not "second"


async def test_a_broken_mutation_fails_alone_among_concurrent_ones(database: Database, store: SqlRoomStore) -> None:
    good = [RoomDriver(store, room_id=f"ok{n}") for n in range(3)]
    broken = RoomDriver(store, room_id="broken")
    for r in (*good, broken):
        await r.create()
    bad = broken.mutation(c.JoinRoom(user_id="bob"))
    # the same event_id as a committed row: the outbox insert violates its unique key (a bug, not a race)
    async with database.read() as conn:
        taken = await conn.scalar(sa.select(t.room_outbox.c.event_id).where(t.room_outbox.c.room_id == "broken"))
    clash = dataclasses.replace(bad, events=(dataclasses.replace(bad.events[0], event_id=taken),))
    results = await asyncio.gather(
        *(store.save_mutation(r.mutation(c.JoinRoom(user_id="bob"))) for r in good),
        store.save_mutation(clash),
        return_exceptions=True,
    )
    assert results[:3] == [None, None, None]
    assert isinstance(results[3], sa.exc.IntegrityError)
    for r in good:
        assert (await meta_row(database, room_id=r.room_id)).version == 2
    assert (await meta_row(database, room_id="broken")).version == 1  # nothing of it stayed


# --------------------------------------------------------------------------- group commit


def _count_commits(db: Database) -> list[int]:
    """A list that grows by one for every COMMIT the engine sends (the database's own count)."""
    commits: list[int] = []
    sync_engine = db._sync_engine or db.engine.sync_engine  # SQLite's units run on the sync engine
    sa.event.listen(sync_engine, "commit", lambda _conn: commits.append(1))
    return commits


def _count_meta_updates(db: Database) -> list[str]:
    """A list that grows by one for every UPDATE of room_meta the engine sends."""
    updates: list[str] = []
    sync_engine = db._sync_engine or db.engine.sync_engine

    @sa.event.listens_for(sync_engine, "before_cursor_execute")
    def seen(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.startswith("UPDATE room_meta"):
            updates.append(statement)

    return updates


async def test_a_mutations_rows_are_written_on_the_drivers_cursor(database: Database, store: SqlRoomStore) -> None:
    """Alone or sharing a transaction, a mutation's statements go to the driver's cursor, not through
    SQLAlchemy's execution of a statement (issue 12: on MariaDB its asyncio bridge was most of a
    command's CPU when commands come one at a time). SQLAlchemy's listeners still hear each one,
    with no execution context."""
    rooms = [RoomDriver(store, room_id=f"drv{n}") for n in range(6)]
    heard: list[tuple[str, bool]] = []
    sync_engine = database._sync_engine or database.engine.sync_engine

    def listen(_conn: Any, _cursor: Any, statement: str, _params: Any, context: Any, _many: bool) -> None:
        if statement.startswith(("INSERT INTO room_", "UPDATE room_meta")):
            heard.append((statement.split(" (")[0].split(" SET")[0], context is None))

    sa.event.listen(sync_engine, "before_cursor_execute", listen)
    try:
        for r in rooms:
            await r.create()  # one at a time: a transaction each
        await rooms[0].run(c.JoinRoom(user_id="alone"))
        results = await asyncio.gather(
            *(r.run(c.JoinRoom(user_id="together")) for r in rooms), return_exceptions=True
        )
    finally:
        sa.event.remove(sync_engine, "before_cursor_execute", listen)
    assert not [r for r in results if isinstance(r, BaseException)]
    kinds = {kind for kind, _ in heard}
    assert kinds == {"INSERT INTO room_meta", "INSERT INTO room_command_log", "INSERT INTO room_outbox",
                     "UPDATE room_meta"}
    assert all(on_driver for _, on_driver in heard), heard
    assert await count(database, t.room_command_log, t.room_command_log.c.room_id.like("drv%")) == 13


async def test_a_rooms_load_a_commands_look_up_and_a_lease_epoch_run_on_the_drivers_cursor(
    database: Database, store: SqlRoomStore, room: RoomDriver
) -> None:
    """The reads of a room's activation (and of a retried command) go to the driver's cursor too: on
    MariaDB each went through SQLAlchemy's asyncio connection (issue 12)."""
    m = await room.create()
    await room.run(c.JoinRoom(user_id="bob"))
    heard: list[tuple[str, bool]] = []
    sync_engine = database._sync_engine or database.engine.sync_engine

    def listen(_conn: Any, _cursor: Any, statement: str, _params: Any, context: Any, _many: bool) -> None:
        if "room_" in statement:
            heard.append((statement.split()[0], context is None))

    sa.event.listen(sync_engine, "before_cursor_execute", listen)
    try:
        loaded = await store.load_room(APP, ROOM)
        logged = await store.find_command(APP, ROOM, m.command_id)
        missing = await store.find_command(APP, ROOM, "never-sent")
        epoch = await store.take_lease_epoch(APP, ROOM)
    finally:
        sa.event.remove(sync_engine, "before_cursor_execute", listen)
    assert loaded.state == room.state and loaded.epoch == 1
    assert logged is not None and logged.response == m.response and logged.version == 1
    assert missing is None
    assert epoch == 2 and await store.take_lease_epoch(APP, "no-such-room") == 0
    assert {kind for kind, _ in heard} == {"SELECT", "UPDATE"}
    assert all(on_driver for _, on_driver in heard), heard


async def test_concurrent_mutations_of_many_rooms_share_transactions(database: Database, store: SqlRoomStore) -> None:
    rooms = [RoomDriver(store, room_id=f"many{n}") for n in range(40)]
    for r in rooms:
        await r.create()
    commits = _count_commits(database)
    updates = _count_meta_updates(database)
    before = store.group_commit_stats()

    mutations = [r.mutation(c.JoinRoom(user_id="bob")) for r in rooms]
    results = await asyncio.gather(*(store.save_mutation(m) for m in mutations), return_exceptions=True)

    assert results == [None] * len(rooms)
    after = store.group_commit_stats()
    transactions = after["transactions"] - before["transactions"]
    assert after["mutations"] - before["mutations"] == len(rooms)
    assert 1 <= transactions < len(rooms)
    assert len(commits) == transactions  # COMMITs sent, not just batches counted
    # the guarded updates: one statement a batch (two for a batch of more than 32 rooms), not one a room
    assert transactions <= len(updates) <= transactions + len(rooms) // 32
    if database.is_sqlite:  # SQLite joins the rooms' VALUES list (CASE terms cost it ~6 us a room more)
        assert any(" FROM (VALUES " in u for u in updates) and not any("CASE WHEN" in u for u in updates)
    assert after["guards_redone"] == before["guards_redone"]
    for r, m in zip(rooms, mutations, strict=True):
        row, state = await meta_row(database, room_id=r.room_id), m.state_after
        assert state is not None
        assert (row.version, row.member_count, row.heat, row.updated_at_ms) == (
            state.version,
            len(state.members),
            state.heat,
            m.now_ms,
        )
    assert await count(database, t.room_command_log, t.room_command_log.c.room_id.like("many%")) == 2 * len(rooms)


async def test_render_ahead_leaves_a_shared_transaction_nothing_to_render(
    database: Database, store: SqlRoomStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After ``render_ahead`` (serve calls it at start-up) no shape of the guarded UPDATE is rendered
    while commands commit: the first seconds of a server's commands paid ~160 ms of CPU for it."""
    monkeypatch.setattr(store_driver, "_RENDERED", {})  # nothing rendered yet, whatever ran before
    rooms = [RoomDriver(store, room_id=f"ahead{n}") for n in range(40)]
    for r in rooms:
        await r.create()
    rendered_before = dict(store_driver._RENDERED)  # (the creations' own inserts)
    store.render_ahead()
    assert len(store_driver._RENDERED) - len(rendered_before) == 32  # one per room count, 1 to 32
    compiled: list[str] = []
    compile_ = sa.sql.dml.Update.compile

    def counting_compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        compiled.append(str(self.table))
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(sa.sql.dml.Update, "compile", counting_compile)
    results = await asyncio.gather(
        *(store.save_mutation(r.mutation(c.JoinRoom(user_id="bob"))) for r in rooms), return_exceptions=True
    )
    assert results == [None] * len(rooms)
    assert compiled == []
    for r in rooms:
        assert (await meta_row(database, room_id=r.room_id)).version == 2


async def test_in_a_shared_transaction_each_kind_of_failure_fails_alone(
    database: Database, store: SqlRoomStore
) -> None:
    """Stale version, stale lease epoch, an existing room, a reused command_id and a clashing
    event_id, all in one batch with good mutations: only the good ones commit, each bad one
    gets its own error, and the batch was shared (fewer transactions than mutations)."""
    good = [RoomDriver(store, room_id=f"fine{n}") for n in range(5)]
    stale_version, fenced = RoomDriver(store, room_id="stale-v"), RoomDriver(store, room_id="fenced")
    reused, clashing, existing = (RoomDriver(store, room_id=n) for n in ("reused", "clashing", "existing"))
    for r in (*good, stale_version, fenced, reused, clashing, existing):
        await r.create()
    await stale_version.run(c.JoinRoom(user_id="moved"))
    stale_version.state = replace(stale_version.state, version=1)  # type: ignore[type-var]  # a cell a version behind
    await store.take_lease_epoch(APP, "fenced")
    await reused.run(c.JoinRoom(user_id="first"), command_id="dup")
    async with database.read() as conn:
        taken = await conn.scalar(sa.select(t.room_outbox.c.event_id).where(t.room_outbox.c.room_id == "fine0"))
    clash = clashing.mutation(c.JoinRoom(user_id="bob"))
    clash = dataclasses.replace(clash, events=(dataclasses.replace(clash.events[0], event_id=taken),))
    again = RoomDriver(store, room_id="existing").mutation(c.CreateRoom(owner_id=OWNER, title="again"))
    before = store.group_commit_stats()
    mutations = [
        *(r.mutation(c.JoinRoom(user_id="bob")) for r in good),
        stale_version.mutation(c.JoinRoom(user_id="late")),
        fenced.mutation(c.JoinRoom(user_id="bob")),
        reused.mutation(c.JoinRoom(user_id="second"), command_id="dup"),
        clash,
        again,
    ]

    results = await asyncio.gather(*(store.save_mutation(m) for m in mutations), return_exceptions=True)

    assert results[:5] == [None] * 5
    assert [type(r) for r in results[5:8]] == [StoreConflict, StoreConflict, CommandIdTaken]
    assert isinstance(results[8], sa.exc.IntegrityError)
    assert type(results[9]) is StoreConflict
    after = store.group_commit_stats()
    assert after["transactions"] - before["transactions"] < len(mutations)
    # the reused command_id and the clash sank the shared INSERTs: the batch was retried one by one
    assert after["retried_alone"] > before["retried_alone"]
    for r in good:
        assert (await meta_row(database, room_id=r.room_id)).version == 2
    versions = {room: (await meta_row(database, room_id=room)).version for room in ("stale-v", "fenced", "reused")}
    assert versions == {"stale-v": 2, "fenced": 1, "reused": 2}
    assert (await meta_row(database, room_id="clashing")).version == 1
    assert (await meta_row(database, room_id="existing")).title == "Friday night"
    assert await count(database, t.room_command_log, t.room_command_log.c.room_id.like("fine%")) == 10


async def test_a_stale_guard_in_a_shared_update_fails_alone_and_the_batch_commits(
    database: Database, store: SqlRoomStore
) -> None:
    """One stale version and one fenced epoch in the batch's one UPDATE: it matches fewer rows than
    rooms, so the batch is redone with an UPDATE a room (not one transaction a mutation), and only
    the two stale ones fail."""
    good = [RoomDriver(store, room_id=f"held{n}") for n in range(6)]
    stale_version, fenced = RoomDriver(store, room_id="behind"), RoomDriver(store, room_id="fenced-off")
    for r in (*good, stale_version, fenced):
        await r.create()
    await stale_version.run(c.JoinRoom(user_id="moved"))
    stale_version.state = replace(stale_version.state, version=1)  # type: ignore[type-var]  # a version behind
    await store.take_lease_epoch(APP, "fenced-off")
    updates = _count_meta_updates(database)
    before = store.group_commit_stats()

    mutations = [
        *(r.mutation(c.JoinRoom(user_id="bob")) for r in good),
        stale_version.mutation(c.JoinRoom(user_id="late")),
        fenced.mutation(c.JoinRoom(user_id="bob")),
    ]
    results = await asyncio.gather(*(store.save_mutation(m) for m in mutations), return_exceptions=True)

    assert results[:6] == [None] * 6
    assert [type(r) for r in results[6:]] == [StoreConflict, StoreConflict]
    after = store.group_commit_stats()
    assert after["transactions"] - before["transactions"] == 1  # one batch
    assert after["guards_redone"] - before["guards_redone"] == 1
    assert after["retried_alone"] == before["retried_alone"]
    assert len(updates) == 1 + len(mutations)  # the shared UPDATE, then one a room
    for r in good:
        assert (await meta_row(database, room_id=r.room_id)).version == 2
    assert (await meta_row(database, room_id="behind")).version == 2  # "moved", not "late"
    assert (await meta_row(database, room_id="fenced-off")).version == 1
    assert await count(database, t.room_command_log, t.room_command_log.c.room_id.like("held%")) == 12
    assert await count(database, t.room_outbox, t.room_outbox.c.room_id.in_(["behind", "fenced-off"])) == 3


async def test_callers_are_answered_only_after_the_shared_commit_and_all_fail_with_it(
    database: Database, store: SqlRoomStore
) -> None:
    rooms = [RoomDriver(store, room_id=f"wait{n}") for n in range(12)]
    for r in rooms:
        await r.create()
    tasks: list[asyncio.Task[None]] = []
    answered_at_commit: list[int] = []
    fail = [False]
    sync_engine = database._sync_engine or database.engine.sync_engine

    @sa.event.listens_for(sync_engine, "commit")
    def at_commit(_conn: Any) -> None:
        answered_at_commit.append(sum(task.done() for task in tasks))
        if fail[0]:
            raise sa.exc.OperationalError("COMMIT", {}, Exception("connection lost during COMMIT"))

    tasks.extend(asyncio.create_task(store.save_mutation(r.mutation(c.JoinRoom(user_id="a")))) for r in rooms)
    assert await asyncio.gather(*tasks, return_exceptions=True) == [None] * len(rooms)
    assert answered_at_commit and set(answered_at_commit) == {0}  # nobody was answered before a COMMIT

    fail[0] = True
    tasks.clear()
    answered_at_commit.clear()
    versions = [(await meta_row(database, room_id=r.room_id)).version for r in rooms]
    tasks.extend(asyncio.create_task(store.save_mutation(r.mutation(c.JoinRoom(user_id="b")))) for r in rooms)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    sa.event.remove(sync_engine, "commit", at_commit)

    assert all(isinstance(r, StoreUnavailable) for r in results), results  # outcome unknown: reload
    assert set(answered_at_commit) == {0}
    assert [(await meta_row(database, room_id=r.room_id)).version for r in rooms] == versions  # nothing stayed
