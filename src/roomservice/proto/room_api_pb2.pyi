from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateRoomRequest(_message.Message):
    __slots__ = ("app_code", "room_id", "command_id", "owner_id", "title", "seat_count")
    APP_CODE_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    SEAT_COUNT_FIELD_NUMBER: _ClassVar[int]
    app_code: str
    room_id: str
    command_id: str
    owner_id: str
    title: str
    seat_count: int
    def __init__(self, app_code: _Optional[str] = ..., room_id: _Optional[str] = ..., command_id: _Optional[str] = ..., owner_id: _Optional[str] = ..., title: _Optional[str] = ..., seat_count: _Optional[int] = ...) -> None: ...

class JoinRoomRequest(_message.Message):
    __slots__ = ("app_code", "room_id", "command_id", "user_id")
    APP_CODE_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    app_code: str
    room_id: str
    command_id: str
    user_id: str
    def __init__(self, app_code: _Optional[str] = ..., room_id: _Optional[str] = ..., command_id: _Optional[str] = ..., user_id: _Optional[str] = ...) -> None: ...

class LeaveRoomRequest(_message.Message):
    __slots__ = ("app_code", "room_id", "command_id", "user_id")
    APP_CODE_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    app_code: str
    room_id: str
    command_id: str
    user_id: str
    def __init__(self, app_code: _Optional[str] = ..., room_id: _Optional[str] = ..., command_id: _Optional[str] = ..., user_id: _Optional[str] = ...) -> None: ...

class TakeMicRequest(_message.Message):
    __slots__ = ("app_code", "room_id", "command_id", "user_id", "seat")
    APP_CODE_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    SEAT_FIELD_NUMBER: _ClassVar[int]
    app_code: str
    room_id: str
    command_id: str
    user_id: str
    seat: int
    def __init__(self, app_code: _Optional[str] = ..., room_id: _Optional[str] = ..., command_id: _Optional[str] = ..., user_id: _Optional[str] = ..., seat: _Optional[int] = ...) -> None: ...

class LeaveMicRequest(_message.Message):
    __slots__ = ("app_code", "room_id", "command_id", "user_id")
    APP_CODE_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    app_code: str
    room_id: str
    command_id: str
    user_id: str
    def __init__(self, app_code: _Optional[str] = ..., room_id: _Optional[str] = ..., command_id: _Optional[str] = ..., user_id: _Optional[str] = ...) -> None: ...

class SendGiftRequest(_message.Message):
    __slots__ = ("app_code", "room_id", "command_id", "sender_id", "receiver_id", "gift_id", "count")
    APP_CODE_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    GIFT_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    app_code: str
    room_id: str
    command_id: str
    sender_id: str
    receiver_id: str
    gift_id: str
    count: int
    def __init__(self, app_code: _Optional[str] = ..., room_id: _Optional[str] = ..., command_id: _Optional[str] = ..., sender_id: _Optional[str] = ..., receiver_id: _Optional[str] = ..., gift_id: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class KickUserRequest(_message.Message):
    __slots__ = ("app_code", "room_id", "command_id", "operator_id", "target_id", "ban_seconds")
    APP_CODE_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    BAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    app_code: str
    room_id: str
    command_id: str
    operator_id: str
    target_id: str
    ban_seconds: int
    def __init__(self, app_code: _Optional[str] = ..., room_id: _Optional[str] = ..., command_id: _Optional[str] = ..., operator_id: _Optional[str] = ..., target_id: _Optional[str] = ..., ban_seconds: _Optional[int] = ...) -> None: ...

class CloseRoomRequest(_message.Message):
    __slots__ = ("app_code", "room_id", "command_id", "operator_id")
    APP_CODE_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    app_code: str
    room_id: str
    command_id: str
    operator_id: str
    def __init__(self, app_code: _Optional[str] = ..., room_id: _Optional[str] = ..., command_id: _Optional[str] = ..., operator_id: _Optional[str] = ...) -> None: ...

class OpenTreasureRequest(_message.Message):
    __slots__ = ("app_code", "room_id", "command_id", "box_id", "level", "open_at_ms")
    APP_CODE_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    BOX_ID_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    OPEN_AT_MS_FIELD_NUMBER: _ClassVar[int]
    app_code: str
    room_id: str
    command_id: str
    box_id: str
    level: int
    open_at_ms: int
    def __init__(self, app_code: _Optional[str] = ..., room_id: _Optional[str] = ..., command_id: _Optional[str] = ..., box_id: _Optional[str] = ..., level: _Optional[int] = ..., open_at_ms: _Optional[int] = ...) -> None: ...

class RoomMember(_message.Message):
    __slots__ = ("user_id", "role", "joined_at_ms")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    JOINED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    role: str
    joined_at_ms: int
    def __init__(self, user_id: _Optional[str] = ..., role: _Optional[str] = ..., joined_at_ms: _Optional[int] = ...) -> None: ...

class RoomSeat(_message.Message):
    __slots__ = ("index", "user_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    user_id: str
    def __init__(self, index: _Optional[int] = ..., user_id: _Optional[str] = ...) -> None: ...

class RoomTreasure(_message.Message):
    __slots__ = ("energy", "level", "box_id", "state", "open_at_ms")
    ENERGY_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    BOX_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OPEN_AT_MS_FIELD_NUMBER: _ClassVar[int]
    energy: int
    level: int
    box_id: str
    state: str
    open_at_ms: int
    def __init__(self, energy: _Optional[int] = ..., level: _Optional[int] = ..., box_id: _Optional[str] = ..., state: _Optional[str] = ..., open_at_ms: _Optional[int] = ...) -> None: ...

class RoomView(_message.Message):
    __slots__ = ("app_code", "room_id", "version", "owner_id", "title", "status", "members", "seats", "heat", "treasure")
    APP_CODE_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SEATS_FIELD_NUMBER: _ClassVar[int]
    HEAT_FIELD_NUMBER: _ClassVar[int]
    TREASURE_FIELD_NUMBER: _ClassVar[int]
    app_code: str
    room_id: str
    version: int
    owner_id: str
    title: str
    status: str
    members: _containers.RepeatedCompositeFieldContainer[RoomMember]
    seats: _containers.RepeatedCompositeFieldContainer[RoomSeat]
    heat: int
    treasure: RoomTreasure
    def __init__(self, app_code: _Optional[str] = ..., room_id: _Optional[str] = ..., version: _Optional[int] = ..., owner_id: _Optional[str] = ..., title: _Optional[str] = ..., status: _Optional[str] = ..., members: _Optional[_Iterable[_Union[RoomMember, _Mapping]]] = ..., seats: _Optional[_Iterable[_Union[RoomSeat, _Mapping]]] = ..., heat: _Optional[int] = ..., treasure: _Optional[_Union[RoomTreasure, _Mapping]] = ...) -> None: ...

class CommittedEvent(_message.Message):
    __slots__ = ("event_id", "type")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    type: str
    def __init__(self, event_id: _Optional[str] = ..., type: _Optional[str] = ...) -> None: ...

class CommandReply(_message.Message):
    __slots__ = ("room", "version", "events", "replayed")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    room: RoomView
    version: int
    events: _containers.RepeatedCompositeFieldContainer[CommittedEvent]
    replayed: bool
    def __init__(self, room: _Optional[_Union[RoomView, _Mapping]] = ..., version: _Optional[int] = ..., events: _Optional[_Iterable[_Union[CommittedEvent, _Mapping]]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class GetRoomRequest(_message.Message):
    __slots__ = ("app_code", "room_id")
    APP_CODE_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    app_code: str
    room_id: str
    def __init__(self, app_code: _Optional[str] = ..., room_id: _Optional[str] = ...) -> None: ...

class ListRoomsRequest(_message.Message):
    __slots__ = ("app_code",)
    APP_CODE_FIELD_NUMBER: _ClassVar[int]
    app_code: str
    def __init__(self, app_code: _Optional[str] = ...) -> None: ...

class RoomListEntry(_message.Message):
    __slots__ = ("room_id", "title", "owner_id", "status", "member_count", "heat", "version")
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_COUNT_FIELD_NUMBER: _ClassVar[int]
    HEAT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    room_id: str
    title: str
    owner_id: str
    status: str
    member_count: int
    heat: int
    version: int
    def __init__(self, room_id: _Optional[str] = ..., title: _Optional[str] = ..., owner_id: _Optional[str] = ..., status: _Optional[str] = ..., member_count: _Optional[int] = ..., heat: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class ListRoomsReply(_message.Message):
    __slots__ = ("rooms",)
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    rooms: _containers.RepeatedCompositeFieldContainer[RoomListEntry]
    def __init__(self, rooms: _Optional[_Iterable[_Union[RoomListEntry, _Mapping]]] = ...) -> None: ...

class ListGiftsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Gift(_message.Message):
    __slots__ = ("id", "name", "price")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PRICE_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    price: int
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., price: _Optional[int] = ...) -> None: ...

class ListGiftsReply(_message.Message):
    __slots__ = ("gifts",)
    GIFTS_FIELD_NUMBER: _ClassVar[int]
    gifts: _containers.RepeatedCompositeFieldContainer[Gift]
    def __init__(self, gifts: _Optional[_Iterable[_Union[Gift, _Mapping]]] = ...) -> None: ...
