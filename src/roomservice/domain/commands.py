"""Room write commands: small frozen dataclasses, one per client intent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from roomservice.domain.fieldnames import field_names


@dataclass(frozen=True, slots=True)
class Command:
    name: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.name, **{name: getattr(self, name) for name in field_names(type(self))}}


@dataclass(frozen=True, slots=True)
class CreateRoom(Command):
    name: ClassVar[str] = "CreateRoom"
    owner_id: str
    title: str
    seat_count: int | None = None


@dataclass(frozen=True, slots=True)
class JoinRoom(Command):
    name: ClassVar[str] = "JoinRoom"
    user_id: str


@dataclass(frozen=True, slots=True)
class LeaveRoom(Command):
    name: ClassVar[str] = "LeaveRoom"
    user_id: str


@dataclass(frozen=True, slots=True)
class TakeMic(Command):
    name: ClassVar[str] = "TakeMic"
    user_id: str
    seat: int


@dataclass(frozen=True, slots=True)
class LeaveMic(Command):
    name: ClassVar[str] = "LeaveMic"
    user_id: str


@dataclass(frozen=True, slots=True)
class SendGift(Command):
    name: ClassVar[str] = "SendGift"
    sender_id: str
    receiver_id: str
    gift_id: str
    count: int


@dataclass(frozen=True, slots=True)
class KickUser(Command):
    name: ClassVar[str] = "KickUser"
    operator_id: str
    target_id: str
    ban_seconds: int | None = None


@dataclass(frozen=True, slots=True)
class CloseRoom(Command):
    name: ClassVar[str] = "CloseRoom"
    operator_id: str


@dataclass(frozen=True, slots=True)
class OpenTreasure(Command):
    """Internal: the treasure wake-up. Its command_id is ``treasure-open:<box_id>``."""

    name: ClassVar[str] = "OpenTreasure"
    box_id: str
    level: int
    open_at_ms: int


COMMAND_TYPES: dict[str, type[Command]] = {
    cls.name: cls
    for cls in (
        CreateRoom,
        JoinRoom,
        LeaveRoom,
        TakeMic,
        LeaveMic,
        SendGift,
        KickUser,
        CloseRoom,
        OpenTreasure,
    )
}


def command_from_dict(data: dict[str, Any]) -> Command:
    fields = dict(data)
    cls = COMMAND_TYPES[fields.pop("type")]
    return cls(**fields)


def treasure_open_command_id(box_id: str) -> str:
    return f"treasure-open:{box_id}"
