"""Request bodies of the HTTP contract: strict types and the input limits of SPEC §3."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from roomservice.domain import commands as c
from roomservice.domain import limits as lim

Id = Annotated[str, Field(pattern=lim.ID_PATTERN, min_length=1, max_length=64)]
RoomId = Annotated[str, Field(pattern=lim.ROOM_ID_PATTERN, min_length=1, max_length=48)]


def _title(value: str) -> str:
    if (problem := lim.title_problem(value)) is not None:
        raise ValueError(problem)
    return value


Title = Annotated[
    str,
    Field(
        min_length=lim.TITLE_MIN,
        max_length=lim.TITLE_MAX,
        description="1-64 code points; not blank; no control characters (Cc), line separators "
        "or bidi embeddings/overrides/isolates (U+202A-U+202E, U+2066-U+2069)",
    ),
    AfterValidator(_title),
]
SeatCount = Annotated[int, Field(ge=lim.SEAT_COUNT_MIN, le=lim.SEAT_COUNT_MAX)]
Seat = Annotated[int, Field(ge=0, le=lim.SEAT_COUNT_MAX - 1)]
GiftCount = Annotated[int, Field(ge=lim.GIFT_COUNT_MIN, le=lim.GIFT_COUNT_MAX)]
BanSeconds = Annotated[int, Field(ge=lim.BAN_SECONDS_MIN, le=lim.BAN_SECONDS_MAX)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    command_id: Id

    def to_command(self) -> c.Command:
        raise NotImplementedError


class CreateRoomBody(_Body):
    room_id: RoomId
    owner_id: Id
    title: Title
    seat_count: SeatCount | None = None

    def to_command(self) -> c.Command:
        return c.CreateRoom(owner_id=self.owner_id, title=self.title, seat_count=self.seat_count)


class UserBody(_Body):
    user_id: Id


class JoinBody(UserBody):
    def to_command(self) -> c.Command:
        return c.JoinRoom(user_id=self.user_id)


class LeaveBody(UserBody):
    def to_command(self) -> c.Command:
        return c.LeaveRoom(user_id=self.user_id)


class LeaveMicBody(UserBody):
    def to_command(self) -> c.Command:
        return c.LeaveMic(user_id=self.user_id)


class TakeMicBody(_Body):
    user_id: Id
    seat: Seat

    def to_command(self) -> c.Command:
        return c.TakeMic(user_id=self.user_id, seat=self.seat)


class GiftBody(_Body):
    sender_id: Id
    receiver_id: Id
    gift_id: Id
    count: GiftCount

    def to_command(self) -> c.Command:
        return c.SendGift(
            sender_id=self.sender_id, receiver_id=self.receiver_id, gift_id=self.gift_id, count=self.count
        )


class KickBody(_Body):
    operator_id: Id
    target_id: Id
    ban_seconds: BanSeconds | None = None

    def to_command(self) -> c.Command:
        return c.KickUser(operator_id=self.operator_id, target_id=self.target_id, ban_seconds=self.ban_seconds)


class CloseBody(_Body):
    operator_id: Id

    def to_command(self) -> c.Command:
        return c.CloseRoom(operator_id=self.operator_id)


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    error: ErrorDetail


class EventRef(BaseModel):
    event_id: str
    type: str


class CommandResponse(BaseModel):
    room: dict[str, object]
    version: int
    events: list[EventRef]
    replayed: bool
