"""Forwarder: local when this process may own the room, one authenticated hop to another owner, never two hops.

The local pipeline is a stub here (what ran locally is recorded); the owner is a
real gRPC room API server over a stub service, so the hop crosses the wire.
tests/e2e/test_scale_out.py runs the same over real processes.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import grpc.aio
import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from roomservice import errors
from roomservice.api import grpc as api
from roomservice.api.errors import http_status
from roomservice.domain import commands as c
from roomservice.forwarding import HOP_KEY, SECRET_KEY, Forwarder
from roomservice.leases.port import LeaseBackendUnavailable, LeaseOwner
from roomservice.service import RoomService

SECRET = "s3cret"


@dataclass
class StubRegistry:
    def peek(self, app_code: str, room_id: str) -> None:
        return None


@dataclass
class StubService:
    name: str
    ran: list[tuple[str, str]] = field(default_factory=list)
    registry: StubRegistry = field(default_factory=StubRegistry)
    refuse: errors.RoomServiceError | None = None  # what the next commands answer instead of a body

    async def execute(self, app_code: str, room_id: str, command_id: str, command: c.Command) -> dict[str, Any]:
        self.ran.append((command_id, command.name))
        if self.refuse is not None:
            raise self.refuse
        room = {"app_code": app_code, "room_id": room_id}
        return {"room": room, "version": len(self.ran), "events": [], "replayed": False}

    async def room(self, app_code: str, room_id: str) -> dict[str, Any]:
        self.ran.append(("view", room_id))
        raise errors.RoomNotFound(f"{self.name} has no {room_id}")


@dataclass
class StubLeases:
    owner: str
    holder: LeaseOwner | None = None
    down: bool = False

    async def owner_of(self, app_code: str, room_id: str) -> LeaseOwner | None:
        if self.down:
            raise LeaseBackendUnavailable("redis unavailable (owner_of): TimeoutError")
        return self.holder


def forwarder(service: StubService, leases: StubLeases, *, secret: str = SECRET) -> Forwarder:
    return Forwarder(cast(RoomService, service), leases=cast(Any, leases), shared_secret=secret, timeout_s=1.0)


@dataclass
class Peer:
    service: StubService
    leases: StubLeases
    forwarder: Forwarder
    address: str


@pytest_asyncio.fixture
async def owner() -> AsyncIterator[Peer]:
    """Process B: holds the room; a third process C holds it in B's eyes when a test says so."""
    service = StubService("B")
    leases = StubLeases(owner="B")
    fwd = forwarder(service, leases)
    running = await api.start_room_api(cast(RoomService, service), servicer=fwd.servicer())
    try:
        yield Peer(service, leases, fwd, running.target)
    finally:
        await running.stop(grace=0)
        await fwd.aclose()


JOIN = c.JoinRoom(user_id="u1")


async def test_nobody_holds_the_room_it_runs_here() -> None:
    local = StubService("A")
    body = await forwarder(local, StubLeases(owner="A")).execute("app", "r1", "c1", JOIN)
    assert local.ran == [("c1", "JoinRoom")] and body["version"] == 1


async def test_our_own_lease_runs_here() -> None:
    local = StubService("A")
    leases = StubLeases(owner="A", holder=LeaseOwner("A", "127.0.0.1:1", "t"))
    await forwarder(local, leases).execute("app", "r1", "c1", JOIN)
    assert local.ran == [("c1", "JoinRoom")]


async def test_another_owner_runs_it_and_its_answer_comes_back(owner: Peer) -> None:
    local = StubService("A")
    leases = StubLeases(owner="A", holder=LeaseOwner("B", owner.address, "t"))
    fwd = forwarder(local, leases)
    try:
        body = await fwd.execute("app", "r1", "c1", JOIN)
    finally:
        await fwd.aclose()
    assert local.ran == []
    assert owner.service.ran == [("c1", "JoinRoom")]
    assert body == {"room": body["room"], "version": 1, "events": [], "replayed": False}


async def test_the_owners_refusal_comes_back_as_its_error(owner: Peer) -> None:
    local = StubService("A")
    fwd = forwarder(local, StubLeases(owner="A", holder=LeaseOwner("B", owner.address, "t")))
    try:
        with pytest.raises(errors.RoomNotFound, match="B has no r1"):
            await fwd.room("app", "r1")
    finally:
        await fwd.aclose()
    assert owner.service.ran == [("view", "r1")] and local.ran == []


async def test_a_treasure_wakeup_for_a_room_another_process_holds_runs_at_the_owner(owner: Peer) -> None:
    """The durable timer and the treasure-open consumer call the forwarder; the owner opens the box."""
    wake = c.OpenTreasure(box_id="20260528-1", level=1, open_at_ms=1_780_000_060_000)
    command_id = c.treasure_open_command_id(wake.box_id)
    local = StubService("A")
    fwd = forwarder(local, StubLeases(owner="A", holder=LeaseOwner("B", owner.address, "t")))
    try:
        body = await fwd.execute("app", "r1", command_id, wake)
        owner.service.refuse = errors.TreasureTooEarly(wake.open_at_ms + 250)  # the owner's clock says not yet
        with pytest.raises(errors.TreasureTooEarly) as info:
            await fwd.execute("app", "r1", command_id, wake)
    finally:
        await fwd.aclose()
    assert local.ran == []
    assert owner.service.ran == [(command_id, "OpenTreasure")] * 2
    assert body["version"] == 1 and fwd.forwarded == 2
    assert info.value.open_at_ms == wake.open_at_ms + 250  # what the caller reschedules to


async def test_a_hop_is_never_forwarded_again(owner: Peer) -> None:
    # B believes C holds the room now; the hop from A must not travel on to C
    owner.leases.holder = LeaseOwner("C", "127.0.0.1:9", "t")
    local = StubService("A")
    fwd = forwarder(local, StubLeases(owner="A", holder=LeaseOwner("B", owner.address, "t")))
    try:
        await fwd.execute("app", "r1", "c1", JOIN)
    finally:
        await fwd.aclose()
    assert owner.service.ran == [("c1", "JoinRoom")]  # B ran it itself (its pipeline answers 503 retry if not owner)
    assert owner.forwarder.forwarded == 0


async def test_a_hop_without_the_secret_is_refused_and_a_plain_call_is_a_gateway_call(owner: Peer) -> None:
    _, request = api.request_of("app", "r1", "c1", JOIN)
    async with grpc.aio.insecure_channel(owner.address) as channel:
        call = channel.unary_unary(
            f"/{api.SERVICE_NAME}/JoinRoom",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=api.pb.CommandReply.FromString,
        )
        for metadata in [((HOP_KEY, "1"),), ((HOP_KEY, "1"), (SECRET_KEY, "wrong"))]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(request, timeout=2, metadata=metadata)
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert owner.service.ran == []
        await call(request, timeout=2)  # no hop marker: a gateway's call, routed as any other
    assert owner.service.ran == [("c1", "JoinRoom")]


async def test_peers_whose_secrets_differ_answer_503_not_the_admin_apis_401(owner: Peer) -> None:
    """A rotation of grpc.shared_secret, or one node misconfigured: the owner refuses the hop. The
    caller's request was fine, so its answer is 503 unavailable (retry), never 401, which SPEC keeps for
    the admin API (found by review). A room view falls back to the store's, as when the owner is away."""
    local = StubService("A")
    fwd = forwarder(local, StubLeases(owner="A", holder=LeaseOwner("B", owner.address, "t")), secret="old-secret")
    try:
        with capture_logs() as logs, pytest.raises(errors.Unavailable, match="shared_secret differs") as info:
            await fwd.execute("app", "r1", "c1", JOIN)
        assert type(info.value) is errors.Unavailable and http_status(info.value) == 503
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["forward_refused"]
        with pytest.raises(errors.RoomNotFound, match="A has no r1"):
            await fwd.room("app", "r1")
    finally:
        await fwd.aclose()
    assert owner.service.ran == []


async def test_an_unreachable_owner_is_503_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    local = StubService("A")
    fwd = forwarder(local, StubLeases(owner="A", holder=LeaseOwner("B", dead, "t")))
    try:
        with pytest.raises(errors.Unavailable, match="retry with the same command_id") as info:
            await fwd.execute("app", "r1", "c1", JOIN)
        assert type(info.value) is errors.Unavailable
        # the room view falls back to the store's (the local service) when the owner is away
        with pytest.raises(errors.RoomNotFound, match="A has no r1"):
            await fwd.room("app", "r1")
    finally:
        await fwd.aclose()
    assert local.ran == [("view", "r1")]


async def test_redis_down_fails_a_command_but_not_a_room_view() -> None:
    local = StubService("A")
    fwd = forwarder(local, StubLeases(owner="A", down=True))
    with pytest.raises(LeaseBackendUnavailable):
        await fwd.execute("app", "r1", "c1", JOIN)
    with pytest.raises(errors.RoomNotFound):
        await fwd.room("app", "r1")
    assert local.ran == [("view", "r1")]
