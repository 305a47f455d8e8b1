"""Forwarding: any process accepts any command; the room's owner runs it.

With ``lease.driver: redis`` several processes serve commands, and a room's
cell lives in the one process holding its lease. :class:`Forwarder` sits in
front of :class:`RoomService` for every entrypoint (HTTP, gRPC, the treasure
timer): before a command runs locally it asks the lease store who holds the
room (``owner_of``). Nobody, or this process: it runs here (taking the lease if
needed). Another live process: the command is sent to it in **one hop** over the
gRPC room API at the address its lease names, with

* ``x-roomservice-peer-secret``: the shared secret (``grpc.shared_secret``),
  which authenticates calls between processes;
* ``x-roomservice-hop: 1``: the hop marker. A server honours it only from an
  authenticated peer (else ``UNAUTHENTICATED``) and then never forwards again:
  it runs the command itself, or answers ``503 retry`` when it does not hold the
  room (someone else took it meanwhile). So a command crosses at most one hop.

The hop is bounded by ``grpc.forward_timeout``. The caller gets the owner's
answer as is: the body (a replay of a retried command_id included) or the error
of the tree (:func:`roomservice.api.grpc.error_of`). An owner that does not
answer in time (paused, partitioned, killed) makes the command ``503
unavailable``: retry with the same command_id; once its lease expires,
``owner_of`` says nobody and a live process takes the room over (the fencing
epoch keeps the former owner from committing).

The room view (``GET …/rooms/{room_id}``) is answered from the owner's live
state (forwarded the same way) or from the store when nobody holds the room, or
when the owner or Redis does not answer (the store holds every committed change).

Without Redis leases (``lease.driver: inprocess``) one process owns every room
and :class:`Forwarder` only calls the local service.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import grpc
import grpc.aio

from roomservice import errors
from roomservice.api import grpc as api
from roomservice.domain import commands as c
from roomservice.leases.port import LeaseBackendUnavailable, LeaseOwner
from roomservice.observability import tracing
from roomservice.observability.logging import get_logger
from roomservice.proto import room_api_pb2 as pb
from roomservice.service import RoomService

if TYPE_CHECKING:
    from roomservice.leases.redis import RedisLeases

_log = get_logger("roomservice.forwarding")

SECRET_KEY: Final = "x-roomservice-peer-secret"
HOP_KEY: Final = "x-roomservice-hop"
CHANNEL_OPTIONS: Final = (
    # an owner that comes back (SIGCONT, a network blip) is reached again quickly
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class PeerUnauthenticated(errors.Unauthorized):
    """A hop-marked call without the right shared secret."""


class Forwarder:
    """The entrypoints' way into the pipeline: local, or one hop to the room's owner (module docstring)."""

    def __init__(
        self,
        service: RoomService,
        *,
        leases: RedisLeases | None = None,
        shared_secret: str = "",
        timeout_s: float = 3.0,
        channel: Callable[[str], grpc.aio.Channel] | None = None,
    ) -> None:
        self.service = service
        self.leases = leases
        self._secret = shared_secret
        self.timeout_s = timeout_s
        self._new_channel = channel or (lambda target: grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS))
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.forwarded = 0  # commands and reads sent to another process (observability, tests)

    # ------------------------------------------------------------------ entrypoints

    async def execute(
        self, app_code: str, room_id: str, command_id: str, command: c.Command, *, metadata: api.Metadata = ()
    ) -> dict[str, Any]:
        """Run a command here or at the room's owner; the HTTP command body, or raises RoomServiceError."""
        if self._hop(metadata):  # the one hop already happened: never forward again
            return await self.service.execute(app_code, room_id, command_id, command)
        owner = await self._other_owner(app_code, room_id, reading=False)
        if owner is None:
            return await self.service.execute(app_code, room_id, command_id, command)
        rpc, request = api.request_of(app_code, room_id, command_id, command)
        reply = await self._call(owner, rpc, request, pb.CommandReply, f"{app_code}/{room_id} {rpc}")
        return api.body_of(reply)

    async def room(self, app_code: str, room_id: str, *, metadata: api.Metadata = ()) -> dict[str, Any]:
        """The room view: the owner's live state, or the store's when nobody holds the room."""
        if self._hop(metadata):
            return await self.service.room(app_code, room_id)
        owner = await self._other_owner(app_code, room_id, reading=True)
        if owner is None:
            return await self.service.room(app_code, room_id)
        request = pb.GetRoomRequest(app_code=app_code, room_id=room_id)
        try:
            reply = await self._call(owner, "GetRoom", request, pb.RoomView, f"{app_code}/{room_id} GetRoom")
        except errors.RoomServiceError as exc:
            if not exc.retryable:
                raise
            return await self.service.room(app_code, room_id)  # the owner is away: the committed state
        return api.to_dict(reply)

    def servicer(self) -> api.RoomApiServicer:
        """The gRPC servicer whose commands and room view go through this forwarder."""
        return api.RoomApiServicer(self.service, execute=self.execute, room=self.room)

    async def aclose(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()

    # ------------------------------------------------------------------ internals

    def _hop(self, metadata: api.Metadata) -> bool:
        """Whether the call is a hop from a peer; a hop without the right secret is refused."""
        values: Mapping[str, str | bytes] = dict(metadata)
        if HOP_KEY not in values:
            return False
        given = values.get(SECRET_KEY, "")
        given_bytes = given.encode() if isinstance(given, str) else given
        if not self._secret or not hmac.compare_digest(given_bytes, self._secret.encode()):
            raise PeerUnauthenticated("a forwarded call needs the peers' shared secret")
        return True

    async def _other_owner(self, app_code: str, room_id: str, *, reading: bool) -> LeaseOwner | None:
        """The live process other than this one holding the room's lease (None: run it here)."""
        if self.leases is None:
            return None
        cell = self.service.registry.peek(app_code, room_id)
        if cell is not None and not cell.retired:
            return None  # this process holds it (the pipeline confirms the lease)
        try:
            owner = await self.leases.owner_of(app_code, room_id)
        except LeaseBackendUnavailable:
            if reading:
                return None  # the store answers a read
            raise
        if owner is None or owner.owner == self.leases.owner:
            return None
        return owner

    async def _call(self, owner: LeaseOwner, rpc: str, request: Any, reply_type: type[Any], what: str) -> Any:
        if not owner.address:
            raise errors.Unavailable(
                f"{what}: the owner {owner.owner} names no address; retry with the same command_id"
            )
        channel = self._channels.get(owner.address)
        if channel is None:
            channel = self._channels[owner.address] = self._new_channel(owner.address)
        method = channel.unary_unary(
            f"/{api.SERVICE_NAME}/{rpc}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=reply_type.FromString,
        )
        self.forwarded += 1
        try:
            metadata = ((SECRET_KEY, self._secret), (HOP_KEY, "1"), *tracing.grpc_metadata())
            return await method(request, timeout=self.timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            error = api.error_of(exc)
            if api.ERROR_CODE_KEY not in dict(exc.trailing_metadata() or ()):  # never reached the owner's pipeline
                _log.warning(
                    "forward_failed", target=owner.address, owner=owner.owner, call=what, status=exc.code().name
                )
                error = errors.Unavailable(
                    f"the room's owner {owner.address} did not answer ({exc.code().name}); "
                    "retry with the same command_id"
                )
            elif isinstance(error, errors.Unauthorized):
                # the owner refused the hop itself (the peers' grpc.shared_secret differ: a rotation, or one
                # node misconfigured); the caller's request was fine, and 401 is the admin API's answer
                _log.warning("forward_refused", target=owner.address, owner=owner.owner, call=what, error=error.message)
                error = errors.Unavailable(
                    f"the room's owner {owner.address} refused this process's forwarded call (grpc.shared_secret "
                    "differs between the peers); retry with the same command_id"
                )
            raise error from None
