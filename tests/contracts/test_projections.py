"""Contract suite of the projections port (``roomservice.projections.port``), one subclass per adapter.

What the port promises: the room list of an app holds its open rooms, busiest
first (most members, then most heat), at most ``limit`` of them, each entry as
the last committed change left it; a closed room leaves the list; presence says
which room a user is in and forgets them when they leave, are kicked or the
room closes; ``seed`` fills the list at start, skipping closed rooms, and an
entry already newer than the seeded one wins. Apps never see each other's rooms
or users.

Rooms are driven through the real domain (``decide`` -> ``stamp`` -> ``replay``),
so every ``room_changed`` carries the states a Room Cell would commit. An
adapter's suite (in-process, Redis) subclasses :class:`ProjectionsContract`
and provides the ``projections`` fixture.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
import pytest_asyncio
from redis.asyncio import Redis
from tests.conftest import RequireService

from roomservice.domain import commands as c
from roomservice.domain.decider import decide, replay, stamp
from roomservice.domain.rules import Gift, RoomRules
from roomservice.domain.state import CLOSED, RoomState
from roomservice.projections.port import InProcessProjections, Projections, RoomListEntry
from roomservice.projections.redis import RedisProjections, connect

APP, OTHER_APP = "app_1", "app_2"
OWNER = "owner"
T0 = 1_780_000_000_000
RULES = RoomRules(gifts={"rose": Gift("rose", "Rose", 10)}, treasure_levels=(1_000_000,))
LIMIT = 50
SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"

_event_ids = (f"evt-{n:08d}" for n in itertools.count())


@dataclass
class Room:
    """One room's committed states, each handed to the projections as the pipeline does."""

    projections: Projections
    room_id: str
    app_code: str = APP
    state: RoomState | None = None
    now_ms: int = T0

    async def run(self, command: c.Command) -> RoomState:
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
        before, self.state = self.state, after
        await self.projections.room_changed(before, after)
        return after

    async def create(self, title: str = "A room") -> RoomState:
        return await self.run(c.CreateRoom(owner_id=OWNER, title=title, seat_count=8))

    async def join(self, *users: str) -> RoomState:
        state = self.state
        for user in users:
            state = await self.run(c.JoinRoom(user_id=user))
        assert state is not None
        return state

    async def leave(self, user: str) -> RoomState:
        return await self.run(c.LeaveRoom(user_id=user))

    async def gift(self, count: int) -> RoomState:
        return await self.run(c.SendGift(sender_id=OWNER, receiver_id=OWNER, gift_id="rose", count=count))

    async def kick(self, user: str) -> RoomState:
        return await self.run(c.KickUser(operator_id=OWNER, target_id=user, ban_seconds=60))

    async def close(self) -> RoomState:
        return await self.run(c.CloseRoom(operator_id=OWNER))


async def listed(projections: Projections, app_code: str = APP, *, limit: int = LIMIT) -> list[str]:
    return [entry.room_id for entry in await projections.list_rooms(app_code, limit=limit)]


def entry(room_id: str, *, version: int, members: int = 1, heat: int = 0, status: str = "open") -> RoomListEntry:
    return RoomListEntry(
        app_code=APP,
        room_id=room_id,
        title=f"seeded {room_id} v{version}",
        owner_id=OWNER,
        status=status,
        member_count=members,
        heat=heat,
        version=version,
    )


class ProjectionsContract:
    """What every :class:`Projections` adapter promises."""

    __test__: ClassVar[bool] = False

    @pytest.fixture
    def projections(self) -> Projections:
        raise NotImplementedError("an adapter's suite provides the projections")

    def room(self, projections: Projections, room_id: str, app_code: str = APP) -> Room:
        return Room(projections, room_id, app_code)

    # ---------------------------------------------------------------- the room list

    async def test_an_empty_app_lists_nothing(self, projections: Projections) -> None:
        assert await projections.list_rooms(APP, limit=LIMIT) == []

    async def test_a_created_room_is_listed_as_committed(self, projections: Projections) -> None:
        state = await self.room(projections, "r1").create(title="Friday night")
        assert await projections.list_rooms(APP, limit=LIMIT) == [RoomListEntry.of(state)]
        (got,) = await projections.list_rooms(APP, limit=LIMIT)
        assert (got.title, got.owner_id, got.status, got.member_count, got.heat, got.version) == (
            "Friday night",
            OWNER,
            "open",
            1,
            0,
            1,
        )

    async def test_the_entry_follows_the_latest_change(self, projections: Projections) -> None:
        room = self.room(projections, "r1")
        await room.create()
        await room.join("bob", "carol")
        await room.gift(3)
        state = await room.leave("carol")
        (got,) = await projections.list_rooms(APP, limit=LIMIT)
        assert got == RoomListEntry.of(state)
        assert (got.member_count, got.heat, got.version) == (2, 30, state.version)

    async def test_busiest_first_members_then_heat(self, projections: Projections) -> None:
        quiet, hot, crowded, crowded_hot = (self.room(projections, r) for r in ("quiet", "hot", "crowded", "ch"))
        for room in (quiet, hot, crowded, crowded_hot):
            await room.create()
        await hot.gift(50)  # 1 member, heat 500
        await crowded.join("a", "b", "c")  # 4 members, heat 0
        await crowded_hot.join("d", "e", "f")
        await crowded_hot.gift(1)  # 4 members, heat 10
        assert await listed(projections) == ["ch", "crowded", "hot", "quiet"]

        await quiet.join("g", "h", "i", "j")  # 5 members: now the busiest
        assert await listed(projections) == ["quiet", "ch", "crowded", "hot"]

    async def test_limit_keeps_the_busiest(self, projections: Projections) -> None:
        for n in range(5):
            room = self.room(projections, f"r{n}")
            await room.create()
            await room.join(*(f"u{n}-{i}" for i in range(n)))  # r4 busiest, r0 quietest
        assert await listed(projections, limit=3) == ["r4", "r3", "r2"]
        assert await listed(projections, limit=1) == ["r4"]
        assert len(await listed(projections, limit=100)) == 5

    async def test_a_closed_room_leaves_the_list(self, projections: Projections) -> None:
        keep, gone = self.room(projections, "keep"), self.room(projections, "gone")
        await keep.create()
        await gone.create()
        await gone.join("bob")
        assert sorted(await listed(projections)) == ["gone", "keep"]
        closed = await gone.close()
        assert closed.status == CLOSED
        assert await listed(projections) == ["keep"]

    async def test_apps_do_not_see_each_others_rooms(self, projections: Projections) -> None:
        await self.room(projections, "r1").create()
        await self.room(projections, "r1", OTHER_APP).create()  # the same room id in another app
        await self.room(projections, "r2", OTHER_APP).create()
        assert await listed(projections) == ["r1"]
        assert sorted(await listed(projections, OTHER_APP)) == ["r1", "r2"]
        assert all(e.app_code == OTHER_APP for e in await projections.list_rooms(OTHER_APP, limit=LIMIT))
        assert await listed(projections, "app_nobody") == []

    # ---------------------------------------------------------------- presence

    async def test_presence_follows_join_and_leave(self, projections: Projections) -> None:
        room = self.room(projections, "r1")
        await room.create()
        assert await projections.room_of(APP, OWNER) == "r1"
        assert await projections.room_of(APP, "bob") is None
        await room.join("bob")
        assert await projections.room_of(APP, "bob") == "r1"
        await room.leave("bob")
        assert await projections.room_of(APP, "bob") is None
        assert await projections.room_of(APP, OWNER) == "r1"

    async def test_a_kicked_user_is_no_longer_present(self, projections: Projections) -> None:
        room = self.room(projections, "r1")
        await room.create()
        await room.join("bob", "carol")
        await room.kick("bob")
        assert await projections.room_of(APP, "bob") is None
        assert await projections.room_of(APP, "carol") == "r1"

    async def test_closing_a_room_clears_its_members_presence(self, projections: Projections) -> None:
        room = self.room(projections, "r1")
        await room.create()
        await room.join("bob", "carol")
        await room.close()
        for user in (OWNER, "bob", "carol"):
            assert await projections.room_of(APP, user) is None

    async def test_leaving_a_room_keeps_presence_in_the_room_joined_since(self, projections: Projections) -> None:
        a, b = self.room(projections, "a"), self.room(projections, "b")
        await a.create()
        await b.create()
        await a.join("bob")
        await b.join("bob")  # bob moved on
        assert await projections.room_of(APP, "bob") == "b"
        await a.leave("bob")  # the older room's leave must not erase where bob is now
        assert await projections.room_of(APP, "bob") == "b"
        await a.close()
        assert await projections.room_of(APP, "bob") == "b"

    async def test_a_change_that_keeps_the_members_leaves_presence_and_updates_the_entry(
        self, projections: Projections
    ) -> None:
        a, b = self.room(projections, "a"), self.room(projections, "b")
        await a.create()
        await b.create()
        await a.join("bob")
        await b.join("bob")  # bob is in b now, and still a member of a
        gifted = await a.gift(3)  # a's members unchanged: nobody's presence moves
        assert await projections.room_of(APP, "bob") == "b"
        assert await projections.room_of(APP, OWNER) == "b"  # the owner of both created b last
        (entry,) = [e for e in await projections.list_rooms(APP, limit=LIMIT) if e.room_id == "a"]
        assert (entry.heat, entry.version) == (gifted.heat, gifted.version) and entry.heat > 0

    async def test_presence_is_per_app(self, projections: Projections) -> None:
        here, there = self.room(projections, "r1"), self.room(projections, "r9", OTHER_APP)
        await here.create()
        await there.create()
        await there.join("bob")
        assert await projections.room_of(OTHER_APP, "bob") == "r9"
        assert await projections.room_of(APP, "bob") is None
        assert await projections.room_of(APP, OWNER) == "r1"
        assert await projections.room_of(OTHER_APP, OWNER) == "r9"

    # ---------------------------------------------------------------- seed

    async def test_seed_fills_the_list_without_closed_rooms(self, projections: Projections) -> None:
        await projections.seed(
            [
                entry("small", version=3, members=1),
                entry("big", version=9, members=7, heat=100),
                entry("closed", version=12, members=0, status=CLOSED),
            ]
        )
        assert await listed(projections) == ["big", "small"]
        (big, _small) = await projections.list_rooms(APP, limit=LIMIT)
        assert big == entry("big", version=9, members=7, heat=100)

    async def test_seed_does_not_overwrite_a_newer_entry(self, projections: Projections) -> None:
        room = self.room(projections, "r1")
        await room.create()
        state = await room.join("bob", "carol")  # version 3, live from the pipeline
        await projections.seed([entry("r1", version=state.version - 1, members=9, heat=999)])
        assert await projections.list_rooms(APP, limit=LIMIT) == [RoomListEntry.of(state)]

    async def test_seed_replaces_an_older_entry(self, projections: Projections) -> None:
        await projections.seed([entry("r1", version=2, members=1)])
        newer = entry("r1", version=5, members=4, heat=20)
        await projections.seed([newer])
        assert await projections.list_rooms(APP, limit=LIMIT) == [newer]

    async def test_seed_is_idempotent(self, projections: Projections) -> None:
        entries = [entry("a", version=2, members=2), entry("b", version=4, members=3)]
        await projections.seed(entries)
        await projections.seed(entries)  # a second start on the same projections
        assert await listed(projections) == ["b", "a"]

    async def test_a_seeded_room_then_changed_by_a_command_follows_the_command(self, projections: Projections) -> None:
        room = self.room(projections, "r1")
        await room.create()
        live = await room.join("bob")
        await projections.seed([replace(RoomListEntry.of(live), title="stale seed", version=1)])
        after = await room.join("carol")
        assert await projections.list_rooms(APP, limit=LIMIT) == [RoomListEntry.of(after)]


# --------------------------------------------------------------------------- adapters


class TestInProcessProjections(ProjectionsContract):
    __test__ = True

    @pytest.fixture
    def projections(self) -> InProcessProjections:
        return InProcessProjections()


class TestInProcessPresenceRestore:
    """After a restart the in-process projections get the list from ``seed`` at once and presence from
    ``restore`` later, from rooms loaded in full meanwhile; what commands projected in between wins."""

    async def test_members_of_loaded_rooms_are_present_unless_a_command_came_first(self) -> None:
        before = InProcessProjections()  # the process before the restart
        quiet, busy, closing, left = (Room(before, r) for r in ("quiet", "busy", "closing", "left"))
        for room in (quiet, busy, closing, left):
            await room.create()
        seeded = [await quiet.join("ann", "bob"), await busy.join("cid"), await closing.join("dan")]
        seeded.append(await left.join("eve", "fay"))

        after = InProcessProjections()  # restarted: the list seeded from the database
        after.expect_restore()
        await after.seed([RoomListEntry.of(state) for state in seeded])
        for room in (quiet, busy, closing, left):
            room.projections = after
        # commands between the seed and the load: the load sees them
        left_now = await left.run(c.LeaveRoom(user_id="fay"))
        other = Room(after, "other")
        await other.create()
        await other.join("eve")  # eve is still in "left" too: the command's answer is the newer
        loaded = [seeded[0], seeded[1], seeded[2], left_now]
        # commands after the load: newer than it
        await busy.join("gus")
        await closing.run(c.CloseRoom(operator_id=OWNER))
        await busy.run(c.LeaveRoom(user_id="cid"))

        assert await after.restore(loaded) == 3  # closing closed since
        present = {u: await after.room_of(APP, u) for u in ("ann", "bob", "cid", "dan", "eve", "fay", "gus")}
        assert present == {
            "ann": "quiet", "bob": "quiet", "cid": None, "dan": None, "eve": "other", "fay": None, "gus": "busy",
        }
        assert sorted(await listed(after)) == ["busy", "left", "other", "quiet"]  # not "closing"
        entries = {e.room_id: e for e in await after.list_rooms(APP, limit=LIMIT)}
        assert entries["busy"] == RoomListEntry.of(busy.state)  # newer than the load: kept

        await quiet.run(c.LeaveRoom(user_id="ann"))  # after the restore, commands project as always
        await other.run(c.LeaveRoom(user_id="eve"))
        assert (await after.room_of(APP, "ann"), await after.room_of(APP, "eve")) == (None, None)


@pytest.fixture
def redis_url(require_service: RequireService) -> str:
    require_service("Redis", "127.0.0.1", 6379)
    return SHARED_REDIS_URL


async def delete_prefix(client: Redis, prefix: str) -> None:
    keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=500)]
    if keys:
        await client.delete(*keys)


class TestRedisProjections(ProjectionsContract):
    """On the shared Redis, under a key prefix of this test alone (its keys are deleted afterwards)."""

    __test__ = True

    @pytest_asyncio.fixture
    async def projections(self, redis_url: str) -> AsyncIterator[RedisProjections]:
        prefix = f"test:{secrets.token_hex(6)}:"
        adapter = RedisProjections(connect(redis_url), prefix=prefix)
        try:
            yield adapter
        finally:
            await delete_prefix(adapter.client, prefix)
            await adapter.close()
