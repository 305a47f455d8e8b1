from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoomCreated(_message.Message):
    __slots__ = ("owner_id", "title", "seat_count")
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    SEAT_COUNT_FIELD_NUMBER: _ClassVar[int]
    owner_id: str
    title: str
    seat_count: int
    def __init__(self, owner_id: _Optional[str] = ..., title: _Optional[str] = ..., seat_count: _Optional[int] = ...) -> None: ...

class RoomUserJoined(_message.Message):
    __slots__ = ("user_id", "role")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    role: str
    def __init__(self, user_id: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class RoomUserLeft(_message.Message):
    __slots__ = ("user_id",)
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    def __init__(self, user_id: _Optional[str] = ...) -> None: ...

class RoomMicTaken(_message.Message):
    __slots__ = ("user_id", "seat")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    SEAT_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    seat: int
    def __init__(self, user_id: _Optional[str] = ..., seat: _Optional[int] = ...) -> None: ...

class RoomMicLeft(_message.Message):
    __slots__ = ("user_id", "seat")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    SEAT_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    seat: int
    def __init__(self, user_id: _Optional[str] = ..., seat: _Optional[int] = ...) -> None: ...

class RoomGiftSent(_message.Message):
    __slots__ = ("sender_id", "receiver_id", "gift_id", "count", "unit_price", "total_value")
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    GIFT_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    UNIT_PRICE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_VALUE_FIELD_NUMBER: _ClassVar[int]
    sender_id: str
    receiver_id: str
    gift_id: str
    count: int
    unit_price: int
    total_value: int
    def __init__(self, sender_id: _Optional[str] = ..., receiver_id: _Optional[str] = ..., gift_id: _Optional[str] = ..., count: _Optional[int] = ..., unit_price: _Optional[int] = ..., total_value: _Optional[int] = ...) -> None: ...

class RoomUserKicked(_message.Message):
    __slots__ = ("operator_id", "target_id", "ban_seconds", "banned_until_ms")
    OPERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    BAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BANNED_UNTIL_MS_FIELD_NUMBER: _ClassVar[int]
    operator_id: str
    target_id: str
    ban_seconds: int
    banned_until_ms: int
    def __init__(self, operator_id: _Optional[str] = ..., target_id: _Optional[str] = ..., ban_seconds: _Optional[int] = ..., banned_until_ms: _Optional[int] = ...) -> None: ...

class RoomClosed(_message.Message):
    __slots__ = ("operator_id",)
    OPERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    operator_id: str
    def __init__(self, operator_id: _Optional[str] = ...) -> None: ...

class RoomTreasureCountdownStarted(_message.Message):
    __slots__ = ("box_id", "level", "open_at_ms", "open_command_id")
    BOX_ID_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    OPEN_AT_MS_FIELD_NUMBER: _ClassVar[int]
    OPEN_COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    box_id: str
    level: int
    open_at_ms: int
    open_command_id: str
    def __init__(self, box_id: _Optional[str] = ..., level: _Optional[int] = ..., open_at_ms: _Optional[int] = ..., open_command_id: _Optional[str] = ...) -> None: ...

class RoomTreasureOpened(_message.Message):
    __slots__ = ("box_id", "level", "recipients")
    BOX_ID_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    RECIPIENTS_FIELD_NUMBER: _ClassVar[int]
    box_id: str
    level: int
    recipients: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, box_id: _Optional[str] = ..., level: _Optional[int] = ..., recipients: _Optional[_Iterable[str]] = ...) -> None: ...

class RoomOutboxEvent(_message.Message):
    __slots__ = ("event_id", "app_code", "room_id", "room_version", "type", "occurred_at_ms", "repair_of", "room_created", "room_user_joined", "room_user_left", "room_mic_taken", "room_mic_left", "room_gift_sent", "room_user_kicked", "room_closed", "room_treasure_countdown_started", "room_treasure_opened")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    APP_CODE_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_VERSION_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    OCCURRED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    REPAIR_OF_FIELD_NUMBER: _ClassVar[int]
    ROOM_CREATED_FIELD_NUMBER: _ClassVar[int]
    ROOM_USER_JOINED_FIELD_NUMBER: _ClassVar[int]
    ROOM_USER_LEFT_FIELD_NUMBER: _ClassVar[int]
    ROOM_MIC_TAKEN_FIELD_NUMBER: _ClassVar[int]
    ROOM_MIC_LEFT_FIELD_NUMBER: _ClassVar[int]
    ROOM_GIFT_SENT_FIELD_NUMBER: _ClassVar[int]
    ROOM_USER_KICKED_FIELD_NUMBER: _ClassVar[int]
    ROOM_CLOSED_FIELD_NUMBER: _ClassVar[int]
    ROOM_TREASURE_COUNTDOWN_STARTED_FIELD_NUMBER: _ClassVar[int]
    ROOM_TREASURE_OPENED_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    app_code: str
    room_id: str
    room_version: int
    type: str
    occurred_at_ms: int
    repair_of: str
    room_created: RoomCreated
    room_user_joined: RoomUserJoined
    room_user_left: RoomUserLeft
    room_mic_taken: RoomMicTaken
    room_mic_left: RoomMicLeft
    room_gift_sent: RoomGiftSent
    room_user_kicked: RoomUserKicked
    room_closed: RoomClosed
    room_treasure_countdown_started: RoomTreasureCountdownStarted
    room_treasure_opened: RoomTreasureOpened
    def __init__(self, event_id: _Optional[str] = ..., app_code: _Optional[str] = ..., room_id: _Optional[str] = ..., room_version: _Optional[int] = ..., type: _Optional[str] = ..., occurred_at_ms: _Optional[int] = ..., repair_of: _Optional[str] = ..., room_created: _Optional[_Union[RoomCreated, _Mapping]] = ..., room_user_joined: _Optional[_Union[RoomUserJoined, _Mapping]] = ..., room_user_left: _Optional[_Union[RoomUserLeft, _Mapping]] = ..., room_mic_taken: _Optional[_Union[RoomMicTaken, _Mapping]] = ..., room_mic_left: _Optional[_Union[RoomMicLeft, _Mapping]] = ..., room_gift_sent: _Optional[_Union[RoomGiftSent, _Mapping]] = ..., room_user_kicked: _Optional[_Union[RoomUserKicked, _Mapping]] = ..., room_closed: _Optional[_Union[RoomClosed, _Mapping]] = ..., room_treasure_countdown_started: _Optional[_Union[RoomTreasureCountdownStarted, _Mapping]] = ..., room_treasure_opened: _Optional[_Union[RoomTreasureOpened, _Mapping]] = ...) -> None: ...
