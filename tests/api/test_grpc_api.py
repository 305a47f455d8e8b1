"""The gRPC room API answers as the HTTP API does: same bodies, same validation, the same error codes.

Both faces are served by one real Process on SQLite: HTTP in process (ASGI), gRPC
on a real loopback port, called with a grpc.aio client.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
import grpc.aio
import httpx
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2, status_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from structlog.testing import capture_logs
from tests.api.conftest import ADMIN_TOKEN
from tests.service.conftest import T0, Clock, make_settings
from tests.tracing.test_tracing_chain import eventually

from roomservice import errors
from roomservice.api import grpc as room_grpc
from roomservice.api.app import ApiContext, create_app
from roomservice.api.errors import HTTP_STATUS
from roomservice.bootstrap import API, MAINTENANCE, Process
from roomservice.brokers.port import Delivery
from roomservice.consumers.treasure_open import TreasureOpenHandler
from roomservice.domain import commands as c
from roomservice.domain.events import Event, RoomTreasureCountdownStarted
from roomservice.forwarding import HOP_KEY, SECRET_KEY, Forwarder
from roomservice.leases.port import LeaseOwner
from roomservice.proto import room_api_pb2 as pb
from roomservice.proto import room_api_pb2_grpc as pb_grpc
from roomservice.service import RoomService
from roomservice.timers.delay_message import TreasureWakeup
from roomservice.timers.treasure import DatabaseTreasureTimer, FireReport, is_permanent
from roomservice.wallet.fake import FakeWallet

BASE = "/v1/apps/demo/rooms"


class Faces:
    """The same process over HTTP and over gRPC."""

    def __init__(self, process: Process, wallet: FakeWallet, http: httpx.AsyncClient, stub: Any, api: Any) -> None:
        self.process = process
        self.wallet = wallet
        self.http = http
        self.stub = stub
        self.api = api


@pytest_asyncio.fixture
async def wallet() -> FakeWallet:
    return FakeWallet(starting_balance=10_000)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest_asyncio.fixture
async def process(tmp_path: Path, wallet: FakeWallet, clock: Clock) -> AsyncIterator[Process]:
    settings = make_settings(f"sqlite+aiosqlite:///{tmp_path}/room.db", tmp_path)
    async with Process.running(settings, clock=clock, wallet=wallet, roles=(API, MAINTENANCE), loops=False) as rt:
        yield rt


@pytest_asyncio.fixture
async def faces(process: Process, wallet: FakeWallet) -> AsyncIterator[Faces]:
    app = create_app(ApiContext(service=process.service, health=process.health, admin_token=ADMIN_TOKEN))
    api = await room_grpc.start_room_api(process.service, host="127.0.0.1", port=0)
    assert api.port > 0
    try:
        async with (
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://room.test") as http,
            grpc.aio.insecure_channel(api.target) as channel,
        ):
            yield Faces(process, wallet, http, pb_grpc.RoomApiStub(channel), api)
    finally:
        await api.stop(0)


# the HTTP route and the rpc of every command: path suffix (None: create), rpc, request message
_ROUTES: dict[str, str | None] = {
    "CreateRoom": None,
    "JoinRoom": "join",
    "LeaveRoom": "leave",
    "TakeMic": "mic/take",
    "LeaveMic": "mic/leave",
    "SendGift": "gifts",
    "KickUser": "kick",
    "CloseRoom": "close",
}


async def _http(faces: Faces, rpc: str, room_id: str, fields: dict[str, Any], app: str = "demo") -> httpx.Response:
    suffix = _ROUTES[rpc]
    base = f"/v1/apps/{app}/rooms"
    if suffix is None:
        return await faces.http.post(base, json={**fields, "room_id": room_id})
    return await faces.http.post(f"{base}/{room_id}/{suffix}", json=fields)


async def _grpc(faces: Faces, rpc: str, room_id: str, fields: dict[str, Any], app: str = "demo") -> Any:
    request = getattr(pb, f"{rpc}Request")(app_code=app, room_id=room_id, **fields)
    return await getattr(faces.stub, rpc)(request)


def _normalized(body: dict[str, Any]) -> dict[str, Any]:
    """A body without what differs between two rooms given the same commands: ids."""
    body = copy.deepcopy(body)
    room = body.get("room", body)
    room["room_id"] = "<room>"
    if room["treasure"]["box_id"] is not None:
        room["treasure"]["box_id"] = "<box>"
    for event in body.get("events", ()):
        assert event["event_id"]
        event["event_id"] = "<event>"
    return body


CHAIN: list[tuple[str, dict[str, Any]]] = [
    ("CreateRoom", {"command_id": "c1", "owner_id": "alice", "title": "Hello 🎤", "seat_count": 6}),
    ("JoinRoom", {"command_id": "c2", "user_id": "bob"}),
    ("JoinRoom", {"command_id": "c3", "user_id": "carol"}),
    ("TakeMic", {"command_id": "c4", "user_id": "bob", "seat": 2}),
    ("SendGift", {"command_id": "c5", "sender_id": "bob", "receiver_id": "alice", "gift_id": "rose", "count": 3}),
    ("LeaveMic", {"command_id": "c6", "user_id": "bob"}),
    ("LeaveRoom", {"command_id": "c7", "user_id": "bob"}),
    ("KickUser", {"command_id": "c8", "operator_id": "alice", "target_id": "carol", "ban_seconds": 600}),
    ("JoinRoom", {"command_id": "c9", "user_id": "dave"}),
    ("TakeMic", {"command_id": "c10", "user_id": "dave", "seat": 0}),
    ("KickUser", {"command_id": "c11", "operator_id": "alice", "target_id": "dave"}),
]


async def test_the_whole_chain_answers_the_http_bodies(faces: Faces) -> None:
    versions = []
    with capture_logs() as logs:
        for rpc, fields in CHAIN:
            http = await _http(faces, rpc, "h1", fields)
            assert http.status_code == 200, http.text
            reply = await _grpc(faces, rpc, "g1", fields)
            assert isinstance(reply, pb.CommandReply)
            body = room_grpc.body_of(reply)
            assert body["replayed"] is False
            assert body["events"]  # every step changes the room
            assert _normalized(body) == _normalized(http.json())
            versions.append(body["version"])
    assert versions == list(range(1, len(CHAIN) + 1))
    timings = [e for e in logs if e["event"] == "room_command_timing" and e["room_id"] == "g1"]
    assert [(e["command"], e["result"]) for e in timings] == [(rpc, "ok") for rpc, _ in CHAIN]

    # reads: the same views and lists as HTTP
    for room_id in ("h1", "g1"):
        view = room_grpc.to_dict(await faces.stub.GetRoom(pb.GetRoomRequest(app_code="demo", room_id=room_id)))
        assert view == (await faces.http.get(f"{BASE}/{room_id}")).json()
    assert view["heat"] == 30 and view["seats"][2] == {"index": 2, "user_id": None}
    listing = room_grpc.to_dict(await faces.stub.ListRooms(pb.ListRoomsRequest(app_code="demo")))
    assert listing == (await faces.http.get(BASE)).json()
    assert {r["room_id"] for r in listing["rooms"]} == {"h1", "g1"}
    gifts = room_grpc.to_dict(await faces.stub.ListGifts(pb.ListGiftsRequest()))
    assert gifts["gifts"] == (await faces.http.get("/v1/gifts")).json()
    assert len(gifts["gifts"]) >= 3

    http_close = await _http(faces, "CloseRoom", "h1", {"command_id": "z", "operator_id": "alice"})
    grpc_close = await _grpc(faces, "CloseRoom", "g1", {"command_id": "z", "operator_id": "alice"})
    assert _normalized(room_grpc.body_of(grpc_close)) == _normalized(http_close.json())
    assert room_grpc.body_of(grpc_close)["room"]["status"] == "closed"
    assert room_grpc.to_dict(await faces.stub.ListRooms(pb.ListRoomsRequest(app_code="demo"))) == {"rooms": []}


async def test_a_repeated_command_id_answers_the_original_body_replayed(faces: Faces) -> None:
    create = {"command_id": "c1", "owner_id": "alice", "title": "x"}
    first = room_grpc.body_of(await _grpc(faces, "CreateRoom", "r1", create))
    again = room_grpc.body_of(await _grpc(faces, "CreateRoom", "r1", create))
    assert first["replayed"] is False
    assert again == {**first, "replayed": True}
    # one idempotency across both faces: a gRPC retry of a command sent over HTTP is its replay
    join = {"command_id": "j1", "user_id": "bob"}
    over_http = (await _http(faces, "JoinRoom", "r1", join)).json()
    over_grpc = room_grpc.body_of(await _grpc(faces, "JoinRoom", "r1", join))
    assert over_grpc == {**over_http, "replayed": True}


def _refusal(exc: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    """The status and error code of a refusal, checking both carriers of the code agree."""
    metadata = dict(exc.trailing_metadata() or ())
    code = metadata[room_grpc.ERROR_CODE_KEY]
    status = status_pb2.Status.FromString(metadata[room_grpc.STATUS_DETAILS_KEY])
    assert status.code == exc.code().value[0]
    assert status.message == exc.details() and exc.details()
    [detail] = status.details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    assert (info.reason, info.domain) == (code, "roomservice")
    return exc.code(), code


async def _refused(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return _refusal(caught.value)


S = grpc.StatusCode
# the gRPC status of every error code a command can answer
_EXPECTED_STATUS = {
    "invalid_argument": S.INVALID_ARGUMENT,
    "unknown_gift": S.INVALID_ARGUMENT,
    "insufficient_balance": S.FAILED_PRECONDITION,
    "not_member": S.PERMISSION_DENIED,
    "not_allowed": S.PERMISSION_DENIED,
    "user_banned": S.PERMISSION_DENIED,
    "room_not_found": S.NOT_FOUND,
    "room_exists": S.ALREADY_EXISTS,
    "command_id_reused": S.ALREADY_EXISTS,
    "seat_taken": S.FAILED_PRECONDITION,
    "room_closed": S.FAILED_PRECONDITION,
    "unavailable": S.UNAVAILABLE,
}


async def _both_refuse(
    faces: Faces, code: str, rpc: str, room_id: str, fields: dict[str, Any], app: str = "demo"
) -> None:
    http = await _http(faces, rpc, room_id, fields, app)
    assert http.status_code == HTTP_STATUS[code], http.text
    assert http.json()["error"]["code"] == code
    assert await _refused(_grpc(faces, rpc, room_id, fields, app)) == (_EXPECTED_STATUS[code], code)


INVALID: list[tuple[str, str, dict[str, Any], str]] = [
    # (rpc, room_id, fields, app_code)
    ("CreateRoom", "r9", {"command_id": "v", "owner_id": "alice", "title": "bell\x07"}, "demo"),
    ("CreateRoom", "r9", {"command_id": "v", "owner_id": "alice", "title": "a\u202eb"}, "demo"),
    ("CreateRoom", "r9", {"command_id": "v", "owner_id": "alice", "title": " "}, "demo"),
    ("CreateRoom", "r9", {"command_id": "v", "owner_id": "alice", "title": ""}, "demo"),
    ("CreateRoom", "r9", {"command_id": "v", "owner_id": "alice", "title": "x" * 65}, "demo"),
    ("CreateRoom", "r9", {"command_id": "v", "owner_id": "alice", "title": "x", "seat_count": 21}, "demo"),
    ("CreateRoom", "r9", {"command_id": "v", "owner_id": "alice", "title": "x", "seat_count": 0}, "demo"),
    ("CreateRoom", "r9", {"command_id": "v", "owner_id": "alice", "title": "x", "seat_count": 2**62}, "demo"),
    ("CreateRoom", "r 9", {"command_id": "v", "owner_id": "alice", "title": "x"}, "demo"),
    ("CreateRoom", "r9", {"command_id": "", "owner_id": "alice", "title": "x"}, "demo"),
    ("CreateRoom", "r9", {"command_id": "v", "owner_id": "al ice", "title": "x"}, "demo"),
    ("JoinRoom", "r1", {"command_id": "v", "user_id": "bob"}, "Demo!"),
    ("JoinRoom", "r" * 49, {"command_id": "v", "user_id": "bob"}, "demo"),
    ("JoinRoom", "r1", {"command_id": "v" * 65, "user_id": "bob"}, "demo"),
    ("TakeMic", "r1", {"command_id": "v", "user_id": "alice", "seat": 9}, "demo"),  # the room has 8 seats
    ("TakeMic", "r1", {"command_id": "v", "user_id": "alice", "seat": 20}, "demo"),
    ("TakeMic", "r1", {"command_id": "v", "user_id": "alice", "seat": -1}, "demo"),
    (
        "SendGift",
        "r1",
        {"command_id": "v", "sender_id": "a", "receiver_id": "a", "gift_id": "rose", "count": 10_000},
        "demo",
    ),
    (
        "SendGift",
        "r1",
        {"command_id": "v", "sender_id": "a", "receiver_id": "a", "gift_id": "rose", "count": 0},
        "demo",
    ),
    ("KickUser", "r1", {"command_id": "v", "operator_id": "alice", "target_id": "bob", "ban_seconds": 0}, "demo"),
    (
        "KickUser",
        "r1",
        {"command_id": "v", "operator_id": "alice", "target_id": "bob", "ban_seconds": 2_592_001},
        "demo",
    ),
    ("CloseRoom", "r1", {"command_id": "v", "operator_id": ""}, "demo"),
]


async def test_invalid_input_is_invalid_argument_as_over_http(faces: Faces) -> None:
    await _grpc(faces, "CreateRoom", "r1", {"command_id": "c1", "owner_id": "alice", "title": "x", "seat_count": 8})
    for rpc, room_id, fields, app in INVALID:
        await _both_refuse(faces, "invalid_argument", rpc, room_id, fields, app)
    view = room_grpc.to_dict(await faces.stub.GetRoom(pb.GetRoomRequest(app_code="demo", room_id="r1")))
    assert view["version"] == 1
    assert await _refused(faces.stub.GetRoom(pb.GetRoomRequest(app_code="demo", room_id="r/1"))) == (
        S.INVALID_ARGUMENT,
        "invalid_argument",
    )
    assert await _refused(faces.stub.ListRooms(pb.ListRoomsRequest(app_code=""))) == (
        S.INVALID_ARGUMENT,
        "invalid_argument",
    )


async def test_a_refused_command_logs_its_one_timing_line_and_names_the_field(faces: Faces) -> None:
    fields = {"command_id": "v1", "owner_id": "alice", "title": "tab\there"}
    with capture_logs() as logs, pytest.raises(grpc.aio.AioRpcError) as caught:
        await _grpc(faces, "CreateRoom", "r1", fields)
    http = (await _http(faces, "CreateRoom", "r1", fields)).json()
    assert caught.value.details() == http["error"]["message"]  # worded by the same code
    assert "title" in caught.value.details() and "U+0009" in caught.value.details()
    [timing] = [e for e in logs if e["event"] == "room_command_timing"]
    assert (timing["command"], timing["result"]) == ("CreateRoom", "invalid_argument")
    assert (timing["app_code"], timing["room_id"], timing["command_id"]) == ("demo", "r1", "v1")


async def test_every_command_error_code_has_its_status_and_code(faces: Faces) -> None:
    async def ok(rpc: str, room_id: str, fields: dict[str, Any]) -> None:
        await _grpc(faces, rpc, room_id, fields)

    await _both_refuse(faces, "room_not_found", "JoinRoom", "nope", {"command_id": "j", "user_id": "bob"})
    assert await _refused(faces.stub.GetRoom(pb.GetRoomRequest(app_code="demo", room_id="nope"))) == (
        S.NOT_FOUND,
        "room_not_found",
    )
    create = {"command_id": "c1", "owner_id": "alice", "title": "x"}
    await ok("CreateRoom", "r1", create)
    await _both_refuse(faces, "room_exists", "CreateRoom", "r1", {**create, "command_id": "c2"})
    await _both_refuse(faces, "command_id_reused", "CreateRoom", "r1", {**create, "title": "y"})

    gift = {"command_id": "g", "sender_id": "alice", "receiver_id": "alice", "gift_id": "nope", "count": 1}
    await _both_refuse(faces, "unknown_gift", "SendGift", "r1", gift)
    await _both_refuse(faces, "insufficient_balance", "SendGift", "r1", {**gift, "gift_id": "crown"})
    await _both_refuse(faces, "not_member", "TakeMic", "r1", {"command_id": "m", "user_id": "zed", "seat": 0})
    await _both_refuse(faces, "not_allowed", "CloseRoom", "r1", {"command_id": "x", "operator_id": "zed"})

    await ok("JoinRoom", "r1", {"command_id": "j1", "user_id": "bob"})
    await ok("JoinRoom", "r1", {"command_id": "j2", "user_id": "carol"})
    await ok("TakeMic", "r1", {"command_id": "m1", "user_id": "bob", "seat": 1})
    await _both_refuse(faces, "seat_taken", "TakeMic", "r1", {"command_id": "m2", "user_id": "carol", "seat": 1})
    await ok("KickUser", "r1", {"command_id": "k1", "operator_id": "alice", "target_id": "bob", "ban_seconds": 600})
    await _both_refuse(faces, "user_banned", "JoinRoom", "r1", {"command_id": "j3", "user_id": "bob"})
    await _both_refuse(
        faces, "not_allowed", "KickUser", "r1", {"command_id": "k2", "operator_id": "carol", "target_id": "alice"}
    )

    faces.wallet.down = True
    rose = {"command_id": "g2", "sender_id": "carol", "receiver_id": "alice", "gift_id": "rose", "count": 1}
    await _both_refuse(faces, "unavailable", "SendGift", "r1", rose)
    faces.wallet.down = False
    assert room_grpc.body_of(await _grpc(faces, "SendGift", "r1", rose))["replayed"] is False  # the retry succeeds

    await ok("CloseRoom", "r1", {"command_id": "x1", "operator_id": "alice"})
    await _both_refuse(faces, "room_closed", "JoinRoom", "r1", {"command_id": "j4", "user_id": "dave"})


def test_the_status_table_covers_every_code_of_the_http_table() -> None:
    assert set(room_grpc.GRPC_STATUS) == set(HTTP_STATUS)
    for code, status in _EXPECTED_STATUS.items():
        assert room_grpc.GRPC_STATUS[code] is status
    assert room_grpc.grpc_status(errors.Retry()) is S.UNAVAILABLE
    assert room_grpc.grpc_status(errors.RoomServiceError()) is S.INTERNAL


async def test_reflection_lists_the_service_and_serves_its_descriptor(faces: Faces) -> None:
    async with grpc.aio.insecure_channel(faces.api.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="roomservice.v1.RoomApi"),
        ]
        answers = [answer async for answer in stub.ServerReflectionInfo(iter(requests))]
    services = {s.name for s in answers[0].list_services_response.service}
    assert "roomservice.v1.RoomApi" in services
    assert answers[1].file_descriptor_response.file_descriptor_proto  # a client can build the stubs from it


async def test_forwarding_helpers_round_trip_commands_and_errors(faces: Faces) -> None:
    """What a forwarder needs: a command as its request, the reply as the HTTP body, a refusal as the error."""
    command = c.CreateRoom(owner_id="alice", title="x", seat_count=None)
    rpc, request = room_grpc.request_of("demo", "r1", "c1", command)
    assert not request.HasField("seat_count")  # None stays absent: the default seat count applies
    reply = await getattr(faces.stub, rpc)(request)
    body = room_grpc.body_of(reply)
    assert room_grpc.body_of(room_grpc.reply_of(body)) == body
    assert body == await faces.process.service.execute("demo", "r1", "c1", command) | {"replayed": False}

    rpc, request = room_grpc.request_of("demo", "nope", "j1", c.JoinRoom(user_id="bob"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await getattr(faces.stub, rpc)(request)
    error = room_grpc.error_of(caught.value)
    assert type(error) is errors.RoomNotFound and error.message == errors.RoomNotFound.default_message

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await faces.stub.SendGift(
            pb.SendGiftRequest(
                app_code="demo", room_id="r1", command_id="g", sender_id="a", receiver_id="a", gift_id="rose"
            )
        )
    error = room_grpc.error_of(caught.value)
    assert type(error) is errors.InvalidArgument and "count" in error.message


# --------------------------------------------------------------------------- OpenTreasure, the peers' rpc

SECRET = "s3cret"


@dataclass
class _HeldBy:
    """The lease store as seen from a process that does not hold the room: the owner at ``address`` holds it."""

    address: str
    owner: str = "A"

    async def owner_of(self, app_code: str, room_id: str) -> LeaseOwner:
        return LeaseOwner("B", self.address, "token")


class _HoldsNothing:
    """The room service of that process: no cell here, so every command must cross the hop."""

    def __init__(self) -> None:
        self.registry = self

    def peek(self, app_code: str, room_id: str) -> None:
        return None

    async def execute(self, *args: Any) -> dict[str, Any]:
        raise AssertionError(f"ran in the process that does not hold the room: {args}")


@pytest_asyncio.fixture
async def peer(process: Process) -> AsyncIterator[Forwarder]:
    """The forwarder of another process, for which ``process`` holds every room.

    ``process`` serves the room API as in production: through its own forwarder's servicer, which
    checks the peers' shared secret of a hop and then runs the command itself.
    """
    owner = Forwarder(process.service, shared_secret=SECRET)
    api = await room_grpc.start_room_api(process.service, servicer=owner.servicer())
    held_by = cast(Any, _HeldBy(api.target))
    fwd = Forwarder(cast(RoomService, _HoldsNothing()), leases=held_by, shared_secret=SECRET, timeout_s=5.0)
    try:
        yield fwd
    finally:
        await fwd.aclose()
        await api.stop(0)
        await owner.aclose()


async def _counting_down(faces: Faces, room_id: str) -> tuple[str, c.OpenTreasure]:
    """A room whose level-1 box counts down: the wake-up's command_id and command, as the timer sends them."""
    await _grpc(faces, "CreateRoom", room_id, {"command_id": "c1", "owner_id": "alice", "title": "x"})
    await _grpc(faces, "JoinRoom", room_id, {"command_id": "j1", "user_id": "bob"})
    rules = faces.process.service.rules
    count = -(-rules.treasure_levels[0] // rules.gifts["rocket"].price)
    gift = {"command_id": "g1", "sender_id": "bob", "receiver_id": "alice", "gift_id": "rocket", "count": count}
    treasure = room_grpc.body_of(await _grpc(faces, "SendGift", room_id, gift))["room"]["treasure"]
    assert treasure["state"] == "counting_down" and treasure["open_at_ms"] > T0
    wake = c.OpenTreasure(box_id=treasure["box_id"], level=1, open_at_ms=treasure["open_at_ms"])
    return c.treasure_open_command_id(wake.box_id), wake


async def test_open_treasure_forwarded_to_the_owner_opens_the_box_as_a_local_execute_would(
    faces: Faces, peer: Forwarder, clock: Clock
) -> None:
    command_id, wake = await _counting_down(faces, "r1")
    rpc, request = room_grpc.request_of("demo", "r1", command_id, wake)
    assert rpc == "OpenTreasure"
    assert request == pb.OpenTreasureRequest(
        app_code="demo", room_id="r1", command_id=command_id, box_id=wake.box_id, level=1, open_at_ms=wake.open_at_ms
    )
    clock.now_ms = wake.open_at_ms
    with capture_logs() as logs:
        body = await peer.execute("demo", "r1", command_id, wake)
    assert peer.forwarded == 1
    assert [e["type"] for e in body["events"]] == ["RoomTreasureOpened"] and body["replayed"] is False
    assert body["room"]["treasure"]["box_id"] is None and body["room"]["treasure"]["level"] == 1
    [timing] = [e for e in logs if e["event"] == "room_command_timing"]
    assert (timing["command"], timing["command_id"], timing["result"]) == ("OpenTreasure", command_id, "ok")
    # the owner answered what its own pipeline answers (here a replay of the same command_id)
    assert body == await faces.process.service.execute("demo", "r1", command_id, wake) | {"replayed": False}
    # a second wake-up (a timer fired twice, a redelivery) is a replay across the hop too: the box opens once
    assert await peer.execute("demo", "r1", command_id, wake) == {**body, "replayed": True}


async def test_a_too_early_open_treasure_comes_back_with_the_owners_open_at_ms(
    faces: Faces, peer: Forwarder, clock: Clock
) -> None:
    command_id, wake = await _counting_down(faces, "r1")
    clock.now_ms = wake.open_at_ms - 1
    with pytest.raises(errors.TreasureTooEarly) as caught:
        await peer.execute("demo", "r1", command_id, wake)
    assert caught.value.open_at_ms == wake.open_at_ms
    assert caught.value.message == errors.TreasureTooEarly.default_message

    # on the wire: FAILED_PRECONDITION too_early, the box's open_at_ms in the trailing metadata
    _, request = room_grpc.request_of("demo", "r1", command_id, wake)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await faces.stub.OpenTreasure(request)
    assert _refusal(refused.value) == (S.FAILED_PRECONDITION, "too_early")
    assert dict(refused.value.trailing_metadata())[room_grpc.OPEN_AT_KEY] == str(wake.open_at_ms)
    view = room_grpc.to_dict(await faces.stub.GetRoom(pb.GetRoomRequest(app_code="demo", room_id="r1")))
    assert view["treasure"]["state"] == "counting_down"

    # a too_early without a readable open_at_ms is never dropped as permanent: the caller backs off
    for trailing in [(), ((room_grpc.OPEN_AT_KEY, "soon"),), ((room_grpc.OPEN_AT_KEY, "-5"),)]:
        metadata = grpc.aio.Metadata((room_grpc.ERROR_CODE_KEY, "too_early"), *trailing)
        error = room_grpc.error_of(grpc.aio.AioRpcError(S.FAILED_PRECONDITION, grpc.aio.Metadata(), metadata, "x"))
        assert type(error) is errors.Retry and error.retryable


async def test_the_durable_timer_of_a_process_without_the_room_opens_it_at_the_owner(
    faces: Faces, peer: Forwarder, process: Process, clock: Clock
) -> None:
    """The bug this rpc fixes: the wake-up used to fail before the hop and back off forever."""
    command_id, wake = await _counting_down(faces, "r1")
    countdown = RoomTreasureCountdownStarted(
        box_id=wake.box_id, level=wake.level, open_at_ms=wake.open_at_ms, open_command_id=command_id
    )
    event = Event(event_id="e1", app_code="demo", room_id="r1", room_version=3, occurred_at_ms=T0, payload=countdown)
    # the other process's clock runs 2 s ahead of the owner's: its timer finds the box due first
    ahead = DatabaseTreasureTimer(process.db, clock=lambda: clock.now_ms + 2_000, owner="A")
    await ahead.schedule(event)
    clock.now_ms = wake.open_at_ms - 1_000
    assert await ahead.fire_due(peer.execute) == FireReport(rescheduled=1)
    assert await ahead.next_fire_at() == wake.open_at_ms  # the owner's time, not a backoff
    clock.now_ms = wake.open_at_ms
    assert await ahead.fire_due(peer.execute) == FireReport(fired=1)
    assert peer.forwarded == 2
    view = room_grpc.to_dict(await faces.stub.GetRoom(pb.GetRoomRequest(app_code="demo", room_id="r1")))
    assert view["treasure"]["box_id"] is None and view["treasure"]["level"] == 1


async def test_a_wakeup_that_fails_at_the_owner_is_retried_by_both_wakeup_paths(process: Process) -> None:
    """An unexpected exception at the room's owner crosses the hop as ``internal``: the broker's wake-up
    handler and the durable timer retry it, as they retry the same exception here (found by review: both
    acknowledged it as permanent and the box never opened)."""

    async def broken(*_: Any, **__: Any) -> dict[str, Any]:
        raise RuntimeError("a bug at the owner, before its commit")

    api = await room_grpc.start_room_api(
        process.service, servicer=room_grpc.RoomApiServicer(process.service, execute=broken)
    )
    fwd = Forwarder(
        cast(RoomService, _HoldsNothing()), leases=cast(Any, _HeldBy(api.target)), shared_secret=SECRET, timeout_s=5.0
    )
    wake = c.OpenTreasure(box_id="20260528-1", level=1, open_at_ms=T0)
    wakeup = TreasureWakeup("demo", "r1", wake.box_id, 1, T0, c.treasure_open_command_id(wake.box_id))
    delivery = Delivery("t", "g", "1", wakeup.key, "TreasureOpen", "demo:r1", wakeup.encode(), {}, 1, T0)
    try:
        handler = TreasureOpenHandler(fwd.execute, group="g", topic="t", clock=lambda: T0)
        with pytest.raises(errors.RoomServiceError) as failed:
            await handler.handle(delivery)
        assert failed.value.code == "internal" and not is_permanent(failed.value)
        countdown = RoomTreasureCountdownStarted(
            box_id=wake.box_id, level=1, open_at_ms=T0, open_command_id=wakeup.command_id
        )
        timer = DatabaseTreasureTimer(process.db, clock=lambda: T0, owner="A")
        await timer.schedule(
            Event(event_id="e1", app_code="demo", room_id="r1", room_version=3, occurred_at_ms=T0, payload=countdown)
        )
        assert await timer.fire_due(fwd.execute) == FireReport(failed=1)
        assert fwd.forwarded == 2
    finally:
        await fwd.aclose()
        await api.stop(0)


async def test_a_malformed_open_treasure_request_is_invalid_argument(faces: Faces) -> None:
    valid: dict[str, Any] = {
        "app_code": "demo",
        "room_id": "r1",
        "command_id": "treasure-open:20260528-1",
        "box_id": "20260528-1",
        "level": 1,
        "open_at_ms": T0,
    }
    long_box = "b" * 51  # treasure-open:<box_id> would be 65 characters, over the id limit
    malformed: list[dict[str, Any]] = [
        {"app_code": "Demo!"},
        {"room_id": "r/1"},
        {"command_id": "t1"},  # any other id would dodge the replay that keeps a box from opening twice
        {"command_id": "treasure-open:20260528-2"},
        {"command_id": "", "box_id": ""},
        {"command_id": "treasure-open:", "box_id": ""},
        {"command_id": "treasure-open:a b", "box_id": "a b"},
        {"command_id": f"treasure-open:{long_box}", "box_id": long_box},
        {"level": 0},
        {"level": -1},
        {"open_at_ms": 0},
        {"open_at_ms": -T0},
    ]
    for change in malformed:
        with capture_logs() as logs:
            refusal = await _refused(faces.stub.OpenTreasure(pb.OpenTreasureRequest(**{**valid, **change})))
        assert refusal == (S.INVALID_ARGUMENT, "invalid_argument"), change
        [timing] = [e for e in logs if e["event"] == "room_command_timing"]
        assert (timing["command"], timing["result"]) == ("OpenTreasure", "invalid_argument")
    assert faces.process.service.registry.peek("demo", "r1") is None
    # the valid shape reaches the room, which does not exist
    assert await _refused(faces.stub.OpenTreasure(pb.OpenTreasureRequest(**valid))) == (S.NOT_FOUND, "room_not_found")
    # a hop needs the peers' shared secret here as for every other command
    owner = Forwarder(faces.process.service, shared_secret=SECRET)
    api = await room_grpc.start_room_api(faces.process.service, servicer=owner.servicer())
    try:
        async with grpc.aio.insecure_channel(api.target) as channel:
            stub = pb_grpc.RoomApiStub(channel)
            request = pb.OpenTreasureRequest(**valid)
            for metadata in [((HOP_KEY, "1"),), ((HOP_KEY, "1"), (SECRET_KEY, "wrong"))]:
                assert await _refused(stub.OpenTreasure(request, metadata=metadata)) == (
                    S.UNAUTHENTICATED,
                    "unauthorized",
                )
    finally:
        await api.stop(0)
        await owner.aclose()


async def test_a_reply_field_the_proto_lacks_is_an_internal_error_not_a_silent_drop(process: Process) -> None:
    """If the HTTP body grows a field the .proto does not have, gRPC fails loudly (and says why in the log)."""

    async def grown(app_code: str, room_id: str, command_id: str, command: c.Command, **_: Any) -> dict[str, Any]:
        body = await process.service.execute(app_code, room_id, command_id, command)
        return {**body, "room": {**body["room"], "new_field": 1}}

    api = await room_grpc.start_room_api(
        process.service, servicer=room_grpc.RoomApiServicer(process.service, execute=grown)
    )
    try:
        async with grpc.aio.insecure_channel(api.target) as channel:
            stub = pb_grpc.RoomApiStub(channel)
            request = pb.CreateRoomRequest(app_code="demo", room_id="r1", command_id="c1", owner_id="a", title="x")
            with capture_logs() as logs:
                assert await _refused(stub.CreateRoom(request)) == (S.INTERNAL, "internal")
    finally:
        await api.stop(0)
    assert any(e["event"] == "grpc_unhandled_error" for e in logs)


class _RequireSecret(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        if ("x-peer-secret", "s3cret") in tuple(details.invocation_metadata or ()):
            return await continuation(details)

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "peer secret required")

        return grpc.unary_unary_rpc_method_handler(refuse)


async def test_interceptors_guard_calls_and_the_hook_sees_the_metadata(process: Process) -> None:
    seen: list[tuple[tuple[str, Any], ...]] = []

    async def execute(app_code: str, room_id: str, command_id: str, command: c.Command, *, metadata: Any) -> Any:
        seen.append(metadata)
        return await process.service.execute(app_code, room_id, command_id, command)

    servicer = room_grpc.RoomApiServicer(process.service, execute=execute)
    api = await room_grpc.start_room_api(process.service, servicer=servicer, interceptors=[_RequireSecret()])
    request = pb.CreateRoomRequest(app_code="demo", room_id="r1", command_id="c1", owner_id="a", title="x")
    try:
        async with grpc.aio.insecure_channel(api.target) as channel:
            stub = pb_grpc.RoomApiStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.CreateRoom(request)
            assert caught.value.code() is S.UNAUTHENTICATED
            assert type(room_grpc.error_of(caught.value)) is errors.Unauthorized
            assert seen == []
            reply = await stub.CreateRoom(request, metadata=(("x-peer-secret", "s3cret"), ("x-hop", "1")))
    finally:
        await api.stop(0)
    assert reply.version == 1
    [metadata] = seen
    assert ("x-hop", "1") in metadata


async def test_a_request_over_the_body_limit_is_refused_by_grpc(faces: Faces) -> None:
    request = pb.CreateRoomRequest(app_code="demo", room_id="r1", command_id="c1", owner_id="a", title="x" * 70_000)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await faces.stub.CreateRoom(request)
    assert caught.value.code() is S.RESOURCE_EXHAUSTED
    assert faces.process.service.registry.peek("demo", "r1") is None


def test_the_committed_modules_are_generated_from_the_committed_proto(tmp_path: Path) -> None:
    """scripts/gen-proto's command on room_api.proto reproduces the committed modules byte for byte."""
    from grpc_tools import protoc

    root = Path(__file__).resolve().parents[2]
    args = ["protoc", f"-I{root / 'src'}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}"]
    args += [f"--grpc_python_out={tmp_path}", str(root / "src/roomservice/proto/room_api.proto")]
    assert protoc.main(args) == 0
    for name in ("room_api_pb2.py", "room_api_pb2.pyi", "room_api_pb2_grpc.py"):
        generated = (tmp_path / "roomservice/proto" / name).read_text()
        assert generated == (root / "src/roomservice/proto" / name).read_text(), f"{name}: run scripts/gen-proto"


async def test_bytes_that_are_not_the_request_are_invalid_argument_not_unknown(faces: Faces) -> None:
    valid = {
        "CreateRoom": pb.CreateRoomRequest(app_code="demo", room_id="r1", command_id="c1", owner_id="a", title="xy"),
        "GetRoom": pb.GetRoomRequest(app_code="demo", room_id="xy"),
    }
    async with grpc.aio.insecure_channel(faces.api.target) as channel:
        for method, request in valid.items():
            not_utf8 = request.SerializeToString().replace(b"xy", b"\xff\xfe")  # a string field must be UTF-8
            truncated = b"\x0a\x7f"  # field 1 says 127 bytes follow
            call = channel.unary_unary(f"/roomservice.v1.RoomApi/{method}")
            for raw in (not_utf8, truncated):
                with capture_logs() as logs:
                    assert await _refused(call(raw)) == (S.INVALID_ARGUMENT, "invalid_argument")
                timings = [e for e in logs if e["event"] == "room_command_timing"]
                assert [e["result"] for e in timings] == (["invalid_argument"] if method == "CreateRoom" else [])
    assert faces.process.service.registry.peek("demo", "r1") is None


async def test_take_mic_without_a_seat_is_refused_as_over_http(faces: Faces) -> None:
    """proto3 could not tell an unset seat from seat 0: the user was put on seat 0 where HTTP answers
    400 (found by review). ``seat`` is optional now, as ``seat_count`` and ``ban_seconds`` are."""
    for room in ("h1", "g1"):
        await _grpc(faces, "CreateRoom", room, {"command_id": "c1", "owner_id": "alice", "title": "x"})
        await _grpc(faces, "JoinRoom", room, {"command_id": "j1", "user_id": "bob"})
    fields = {"command_id": "m1", "user_id": "bob"}  # no seat
    http = await _http(faces, "TakeMic", "h1", fields)
    assert http.status_code == 400 and "seat" in http.json()["error"]["message"]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _grpc(faces, "TakeMic", "g1", fields)
    assert _refusal(refused.value) == (S.INVALID_ARGUMENT, "invalid_argument")
    taken = room_grpc.body_of(await _grpc(faces, "TakeMic", "g1", {**fields, "seat": 0}))  # seat 0, said
    assert taken["room"]["seats"][0]["user_id"] == "bob"


@pytest.mark.parametrize("slow", ["save_mutation", "save_snapshot"])
async def test_a_call_cut_off_by_its_deadline_does_not_stop_its_command_half_way(faces: Faces, slow: str) -> None:
    """grpc.aio cancels a handler whose caller's deadline passed; the command was stopped wherever it
    was: after its commit (a join's presence never projected) or in the closing snapshot (a closed room
    listed as open for good). Found by review. The command now runs to its end, as over HTTP."""
    await _grpc(faces, "CreateRoom", "g1", {"command_id": "c1", "owner_id": "alice", "title": "x"})
    await _grpc(faces, "JoinRoom", "g1", {"command_id": "j1", "user_id": "bob"})
    store = faces.process.service.store
    real = getattr(store, slow)
    entered = asyncio.Event()

    async def late(*args: Any, **kwargs: Any) -> Any:
        result = await real(*args, **kwargs)  # done: its acknowledgement is late
        entered.set()
        await asyncio.sleep(0.5)
        return result

    setattr(store, slow, late)
    if slow == "save_mutation":
        request: Any = pb.JoinRoomRequest(app_code="demo", room_id="g1", command_id="j2", user_id="carol")
        call = faces.stub.JoinRoom
    else:
        request = pb.CloseRoomRequest(app_code="demo", room_id="g1", command_id="z", operator_id="alice")
        call = faces.stub.CloseRoom
    with pytest.raises(grpc.aio.AioRpcError) as cut:
        await call(request, timeout=0.2)
    assert cut.value.code() is S.DEADLINE_EXCEEDED and entered.is_set()

    async def projected() -> bool:
        listing = room_grpc.to_dict(await faces.stub.ListRooms(pb.ListRoomsRequest(app_code="demo")))
        if slow == "save_mutation":
            presence = (await faces.http.get("/v1/apps/demo/users/carol/presence")).json()
            return presence["room_id"] == "g1" and listing["rooms"][0]["member_count"] == 3
        return listing == {"rooms": []}

    await eventually(projected, deadline_s=10.0, what="the cut-off command's projections")
    setattr(store, slow, real)
    again = room_grpc.body_of(await call(request))
    assert again["replayed"] is True
