"""Redis projections shared by processes: one list and one presence for all, never going backwards,
rebuilt from the database when Redis lost them, failing fast (and recovering) when Redis is away.

Processes here are real :class:`Process` instances on one database, each given a
:class:`RedisProjections` on the same key prefix (the lead wires the adapter into
bootstrap; these tests put it in place of the in-process one). Tests that stop Redis
start a ``redis-server`` of their own on a free port; the shared one is only ever
written under a key prefix of the test, deleted afterwards.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from redis.asyncio import Redis
from tests.conftest import RequireService
from tests.contracts.test_projections import APP, Room, delete_prefix, listed
from tests.redis_server import REDIS_SERVER, OwnRedisServer
from tests.service.conftest import Clock, make_settings
from tests.tcp_proxy import TcpProxy

from roomservice.api.app import ApiContext, create_app
from roomservice.bootstrap import API, MAINTENANCE, Process
from roomservice.domain import commands as c
from roomservice.domain.state import RoomState
from roomservice.projections.loader import store_loader
from roomservice.projections.port import RoomListEntry
from roomservice.projections.redis import ProjectionsUnavailable, RedisProjections, connect

SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def own_redis() -> Iterator[OwnRedisServer]:
    if not os.path.exists(REDIS_SERVER):
        pytest.fail(f"{REDIS_SERVER} is needed for the Redis outage tests", pytrace=False)
    server = OwnRedisServer()
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(params=["sqlite", "mariadb"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The one database the test's processes share."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path}/room.db"
    url: str = request.getfixturevalue("migrated_mariadb_url")
    return url


@pytest.fixture
def prefix() -> str:
    return f"test:{secrets.token_hex(6)}:"


@pytest_asyncio.fixture
async def shared_redis(require_service: RequireService, prefix: str) -> AsyncIterator[Redis]:
    require_service("Redis", "127.0.0.1", 6379)
    client = connect(SHARED_REDIS_URL)
    try:
        yield client
    finally:
        await delete_prefix(client, prefix)
        await client.aclose()


async def with_redis_projections(
    stack: AsyncExitStack,
    tmp_path: Path,
    name: str,
    *,
    redis_url: str,
    prefix: str,
    timeout_s: float = 1.0,
    clock: Clock | None = None,
    database_url: str | None = None,
) -> Process:
    """A Process on the test's one database whose projections are Redis (rebuilt from its store)."""
    data_dir = tmp_path / name
    data_dir.mkdir()
    settings = make_settings(database_url or f"sqlite+aiosqlite:///{tmp_path}/room.db", data_dir)
    process = await stack.enter_async_context(
        Process.running(settings, clock=clock or Clock(), roles=(API, MAINTENANCE), loops=False)
    )
    projections = RedisProjections.from_url(
        redis_url, prefix=prefix, loader=store_loader(process.store), timeout_s=timeout_s
    )
    stack.push_async_callback(projections.close)
    process.service.projections = projections
    return process


def projections_of(process: Process) -> RedisProjections:
    projections = process.service.projections
    assert isinstance(projections, RedisProjections)
    return projections


_ids = iter(range(1_000_000))


async def run(process: Process, room_id: str, command: c.Command) -> dict[str, object]:
    return await process.service.execute(APP, room_id, f"cmd-{next(_ids)}", command)


async def create(process: Process, room_id: str, owner: str = "owner") -> None:
    await run(process, room_id, c.CreateRoom(owner_id=owner, title=f"room {room_id}", seat_count=8))


async def room_ids(process: Process) -> list[str]:
    return [str(r["room_id"]) for r in await process.service.rooms(APP)]


async def present(process: Process, user_id: str) -> object:
    return (await process.service.presence(APP, user_id))["room_id"]


# --------------------------------------------------------------------------- shared by processes


async def test_two_processes_see_each_others_rooms_and_users(
    tmp_path: Path, database_url: str, shared_redis: Redis, prefix: str
) -> None:
    shared = {"redis_url": SHARED_REDIS_URL, "prefix": prefix, "database_url": database_url}
    async with AsyncExitStack() as stack:
        one = await with_redis_projections(stack, tmp_path, "one", **shared)
        two = await with_redis_projections(stack, tmp_path, "two", **shared)
        await create(one, "r-one")
        await create(two, "r-two", owner="ann")
        await run(two, "r-two", c.JoinRoom(user_id="bob"))
        for process in (one, two):
            assert await room_ids(process) == ["r-two", "r-one"]  # two members before one
            assert await present(process, "bob") == "r-two"
            assert await present(process, "owner") == "r-one"
        await run(one, "r-one", c.CloseRoom(operator_id="owner"))
        assert await room_ids(two) == ["r-two"]
        assert await present(two, "owner") is None


# --------------------------------------------------------------------------- never backwards


async def test_a_stale_update_never_overwrites_a_newer_one(shared_redis: Redis, prefix: str) -> None:
    current = RedisProjections(shared_redis, prefix=prefix)
    fenced = RedisProjections(shared_redis, prefix=prefix)  # a former owner whose updates arrive late
    room = Room(current, "r1")
    s1 = await room.create()
    s2 = await room.join("bob")
    s3 = await room.join("carol")
    s4 = await room.leave("bob")
    assert await current.list_rooms(APP, limit=10) == [RoomListEntry.of(s4)]

    await fenced.room_changed(s1, s2)  # bob joins: older than what Redis holds
    await fenced.room_changed(s2, s3)
    await fenced.room_changed(None, s3)  # a whole state, not a diff: older all the same
    await fenced.seed([RoomListEntry.of(s3)])
    assert await current.list_rooms(APP, limit=10) == [RoomListEntry.of(s4)]
    assert await current.room_of(APP, "bob") is None  # bob's stale join did not come back
    assert await current.room_of(APP, "carol") == "r1"

    s5 = await room.close()
    await fenced.room_changed(s3, s4)  # a late update after the close cannot reopen the room
    assert await listed(current) == []
    assert await current.room_of(APP, "carol") is None
    assert s5.version == s4.version + 1


async def test_a_lost_update_is_repaired_by_the_next(shared_redis: Redis, prefix: str) -> None:
    """The next change finds Redis a version behind its ``before``: it sends the whole member list."""
    projections = RedisProjections(shared_redis, prefix=prefix)
    lossy = Room(RedisProjections(shared_redis, prefix=f"{prefix}void:"), "r1")  # where the lost update went
    s1 = await lossy.create()
    await projections.room_changed(None, s1)
    s2 = await lossy.join("bob", "carol")  # two commits Redis never heard of
    s3 = await lossy.leave("bob")
    await projections.room_changed(s2, s3)  # the diff (bob leaves) alone would never credit carol
    assert await projections.list_rooms(APP, limit=10) == [RoomListEntry.of(s3)]
    assert await projections.room_of(APP, "carol") == "r1"
    assert await projections.room_of(APP, "bob") is None


# --------------------------------------------------------------------------- rebuilt from the database


async def test_redis_emptied_rebuilds_from_the_database_on_the_next_read(
    tmp_path: Path, database_url: str, shared_redis: Redis, prefix: str
) -> None:
    shared = {"redis_url": SHARED_REDIS_URL, "prefix": prefix, "database_url": database_url}
    async with AsyncExitStack() as stack:
        clock = Clock()
        one = await with_redis_projections(stack, tmp_path, "one", clock=clock, **shared)
        two = await with_redis_projections(stack, tmp_path, "two", **shared)
        await create(one, "small")
        clock.advance(1_000)
        await create(one, "big")
        await create(one, "gone")
        for user in ("bob", "carol"):
            await run(one, "big", c.JoinRoom(user_id=user))
        await run(one, "gone", c.CloseRoom(operator_id="owner"))
        before = await one.service.rooms(APP)
        assert [r["room_id"] for r in before] == ["big", "small"]
        assert projections_of(one).rebuilds == 1  # the first read found no marker

        await delete_prefix(shared_redis, prefix)  # Redis lost everything
        assert await shared_redis.exists(projections_of(two).marker_key) == 0
        reads = await asyncio.gather(*(two.service.rooms(APP) for _ in range(5)))
        assert all(got == before for got in reads)
        assert projections_of(two).rebuilds == 1  # single flight: five reads, one rebuild
        assert await present(two, "carol") == "big"
        assert await present(two, "owner") == "big"  # the owner of both open rooms joined big last
        assert await present(one, "nobody") is None
        assert projections_of(one).rebuilds == 1  # the marker is back: the other process did not rebuild


async def test_a_rebuild_puts_a_user_of_several_rooms_in_the_one_joined_last(shared_redis: Redis, prefix: str) -> None:
    scratch = RedisProjections(shared_redis, prefix=f"{prefix}scratch:")
    first, second, third = (Room(scratch, r) for r in ("a-first", "b-second", "c-third"))
    for offset, room in enumerate((first, second, third)):  # created in this order, 100 ms apart
        room.now_ms += offset * 100
        await room.create()
    for offset, room in enumerate((first, third, second)):  # joined in this order, each a minute later
        room.now_ms += offset * 60_000
        await room.join("bob")  # bob's latest join: b-second (the owner's: c-third, created last)
    states = [room.state for room in (first, second, third) if room.state is not None]
    assert len(states) == 3
    for n, order in enumerate((states, states[::-1])):
        projections = RedisProjections(shared_redis, prefix=f"{prefix}{n}:")

        async def load(order: list[RoomState] = order) -> list[RoomState]:
            return order

        assert await projections.rebuild_if_empty(load) is True
        assert await projections.room_of(APP, "bob") == "b-second"
        assert await projections.room_of(APP, "owner") == "c-third"
        assert await projections.rebuild_if_empty(load) is False  # the marker is there now


async def test_without_a_loader_an_emptied_redis_answers_what_it_has(shared_redis: Redis, prefix: str) -> None:
    projections = RedisProjections(shared_redis, prefix=prefix)
    assert await projections.list_rooms(APP, limit=10) == []
    assert projections.rebuilds == 0


async def test_a_failing_rebuild_is_unavailable_and_retried_by_the_next_read(shared_redis: Redis, prefix: str) -> None:
    calls = 0

    async def load() -> list[RoomListEntry]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ProjectionsUnavailable("database down")  # stands for a StoreUnavailable
        return [RoomListEntry(APP, "r1", "t", "owner", "open", 1, 0, 3)]

    projections = RedisProjections(shared_redis, prefix=prefix, loader=load)
    with pytest.raises(ProjectionsUnavailable):
        await projections.list_rooms(APP, limit=10)
    assert await listed(projections) == ["r1"]
    assert calls == 2


async def test_a_rebuild_that_hangs_is_cut_by_its_bound(shared_redis: Redis, prefix: str) -> None:
    never = asyncio.Event()

    async def load() -> list[RoomListEntry]:
        await never.wait()  # a database that does not answer
        return []

    projections = RedisProjections(shared_redis, prefix=prefix, loader=load, rebuild_timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(ProjectionsUnavailable, match="rebuild failed"):
        await projections.room_of(APP, "bob")
    assert time.monotonic() - started < 5.0
    assert await shared_redis.exists(projections.marker_key) == 0  # nothing claims a rebuild happened


# --------------------------------------------------------------------------- Redis down


async def test_redis_down_fails_fast_and_everything_recovers_when_it_returns(
    tmp_path: Path, own_redis: OwnRedisServer, prefix: str
) -> None:
    async with AsyncExitStack() as stack:
        process = await with_redis_projections(
            stack, tmp_path, "one", redis_url=own_redis.url, prefix=prefix, timeout_s=0.5
        )
        await create(process, "r1")
        assert await room_ids(process) == ["r1"]

        own_redis.kill()
        projections = projections_of(process)
        room = Room(projections, "r-direct")
        with pytest.raises(ProjectionsUnavailable):
            await room.create()  # the adapter raises; the pipeline logs it
        answered = await run(process, "r1", c.JoinRoom(user_id="bob"))  # the command does not fail
        assert answered["version"] == 2
        started = time.monotonic()
        with pytest.raises(ProjectionsUnavailable) as raised:
            await process.service.rooms(APP)
        assert time.monotonic() - started < 5.0  # bounded: 2 x 0.5 s socket timeouts at most, not a hang
        assert raised.value.code == "unavailable"
        with pytest.raises(ProjectionsUnavailable):
            await process.service.presence(APP, "bob")

        own_redis.start()  # an empty Redis on the same port: the projections rebuild from the database
        await create(process, "r2")
        assert await room_ids(process) == ["r1", "r2"]  # r1 has two members (bob's join while Redis was away)
        assert await present(process, "bob") == "r1"


async def test_a_hung_redis_is_unavailable_within_the_bound_and_answers_again_when_it_wakes(
    own_redis: OwnRedisServer, prefix: str
) -> None:
    projections = RedisProjections.from_url(own_redis.url, prefix=prefix, timeout_s=0.3)  # calls bounded by 0.6 s
    try:
        room = Room(projections, "r1")
        await room.create()
        own_redis.pause()
        for call in (room.join("bob"), projections.list_rooms(APP, limit=10), projections.room_of(APP, "owner")):
            started = time.monotonic()
            with pytest.raises(ProjectionsUnavailable):
                await call
            assert time.monotonic() - started < 3.0  # the socket timeouts cut it, not a hang
        own_redis.resume()
        state = await room.join("carol")  # Redis still holds v1: bob's lost join is repaired by this whole list
        assert await projections.list_rooms(APP, limit=10) == [RoomListEntry.of(state)]
        assert await projections.room_of(APP, "bob") == "r1"
    finally:
        await projections.close()


# --------------------------------------------------------------------------- HTTP


@pytest_asyncio.fixture
async def http(tmp_path: Path, shared_redis: Redis, prefix: str) -> AsyncIterator[httpx.AsyncClient]:
    async with AsyncExitStack() as stack:
        process = await with_redis_projections(stack, tmp_path, "one", redis_url=SHARED_REDIS_URL, prefix=prefix)
        app = create_app(ApiContext(service=process.service, health=process.health, admin_token="t"))
        client = await stack.enter_async_context(
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://room.test")
        )
        yield client


async def test_http_presence_follows_join_and_leave(http: httpx.AsyncClient) -> None:
    base = f"/v1/apps/{APP}"
    created = await http.post(
        f"{base}/rooms", json={"command_id": "c1", "room_id": "r1", "owner_id": "ann", "title": "x"}
    )
    assert created.status_code == 200, created.text
    presence = f"{base}/users/bob/presence"
    assert (await http.get(presence)).json() == {"app_code": APP, "user_id": "bob", "room_id": None}
    joined = await http.post(f"{base}/rooms/r1/join", json={"command_id": "c2", "user_id": "bob"})
    assert joined.status_code == 200, joined.text
    answer = await http.get(presence)
    assert answer.status_code == 200
    assert answer.json() == {"app_code": APP, "user_id": "bob", "room_id": "r1"}
    left = await http.post(f"{base}/rooms/r1/leave", json={"command_id": "c3", "user_id": "bob"})
    assert left.status_code == 200, left.text
    assert (await http.get(presence)).json()["room_id"] is None
    assert (await http.get(f"{base}/users/ann/presence")).json()["room_id"] == "r1"


@pytest.mark.parametrize(
    "path",
    [
        "/v1/apps/app_1/users/b%20ob/presence",
        "/v1/apps/App-1/users/bob/presence",
        f"/v1/apps/app_1/users/{'u' * 65}/presence",
    ],
)
async def test_http_presence_rejects_a_bad_id(http: httpx.AsyncClient, path: str) -> None:
    answer = await http.get(path)
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "invalid_argument"


async def test_openapi_documents_the_presence_route(http: httpx.AsyncClient) -> None:
    spec = (await http.get("/openapi.json")).json()
    op = spec["paths"]["/v1/apps/{app_code}/users/{user_id}/presence"]["get"]
    assert {"200", "400", "503"} <= set(op["responses"])
    assert op["responses"]["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}


@pytest.mark.parametrize("lost", ["close", "leave"])
async def test_a_projection_lost_while_redis_was_away_is_repaired_without_another_command(
    tmp_path: Path, own_redis: OwnRedisServer, prefix: str, lost: str
) -> None:
    """A projection failure was only logged; a later command of the room healed it (its diff found Redis
    a version behind). A closed room takes no more commands, a quiet one may get none: the closed room
    stayed listed and its members present in it, a user who left stayed present, for good (found by
    review). The pipeline keeps the state it could not project and writes it again once Redis answers."""
    with TcpProxy("127.0.0.1", own_redis.port) as proxy:
        async with AsyncExitStack() as stack:
            process = await with_redis_projections(
                stack, tmp_path, "one", redis_url=f"redis://127.0.0.1:{proxy.port}/0", prefix=prefix, timeout_s=0.3
            )
            await create(process, "r1")
            await run(process, "r1", c.JoinRoom(user_id="bob"))
            assert await room_ids(process) == ["r1"] and await present(process, "bob") == "r1"
            proxy.blackhole()
            command = c.CloseRoom(operator_id="owner") if lost == "close" else c.LeaveRoom(user_id="bob")
            answer = await run(process, "r1", command)  # the command answers; its projection is lost
            assert answer["version"] == 3
            assert [key for key in process.service.unprojected] == [(APP, "r1")]
            assert await process.service.repair_projections() == 0  # still away: kept for the next round
            proxy.forward()
            assert await process.service.repair_projections() == 1
            assert process.service.unprojected == {}
            assert await room_ids(process) == ([] if lost == "close" else ["r1"])
            assert await present(process, "bob") is None


async def test_a_room_the_projections_refuse_does_not_hold_up_the_repair_of_the_others(tmp_path: Path) -> None:
    """Only an outage stops a repair round: a room refused for its own reason goes last in line."""
    async with AsyncExitStack() as stack:
        data_dir = tmp_path / "one"
        data_dir.mkdir()
        settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/room.db", data_dir)
        process = await stack.enter_async_context(
            Process.running(settings, clock=Clock(), roles=(API, MAINTENANCE), loops=False)
        )
        service = process.service
        await create(process, "bad")
        await create(process, "good")
        states = {room: (await process.store.load_room(APP, room)).state for room in ("bad", "good")}
        written: list[str] = []
        real = service.projections.room_changed

        async def refuses_bad(before: RoomState | None, after: RoomState) -> None:
            if after.room_id == "bad":
                raise ValueError("this room's entry does not fit")
            written.append(after.room_id)
            await real(before, after)

        service.projections.room_changed = refuses_bad  # type: ignore[method-assign]
        for room in ("bad", "good"):
            state = states[room]
            assert state is not None
            service.unprojected[(APP, room)] = state
        assert await service.repair_projections() == 1
        assert written == ["good"] and list(service.unprojected) == [(APP, "bad")]
