from roomservice.proto import room_outbox_event_pb2 as _room_outbox_event_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandleRoomEventReply(_message.Message):
    __slots__ = ("duplicate",)
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    def __init__(self, duplicate: _Optional[bool] = ...) -> None: ...

class GiftLeaderboardRequest(_message.Message):
    __slots__ = ("app_code", "room_id", "day", "board", "limit")
    APP_CODE_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    DAY_FIELD_NUMBER: _ClassVar[int]
    BOARD_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    app_code: str
    room_id: str
    day: int
    board: str
    limit: int
    def __init__(self, app_code: _Optional[str] = ..., room_id: _Optional[str] = ..., day: _Optional[int] = ..., board: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class LeaderboardEntry(_message.Message):
    __slots__ = ("user_id", "value")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    value: int
    def __init__(self, user_id: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...

class GiftLeaderboardReply(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[LeaderboardEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[LeaderboardEntry, _Mapping]]] = ...) -> None: ...

class TreasureRewardsRequest(_message.Message):
    __slots__ = ("app_code", "room_id", "box_id")
    APP_CODE_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    BOX_ID_FIELD_NUMBER: _ClassVar[int]
    app_code: str
    room_id: str
    box_id: str
    def __init__(self, app_code: _Optional[str] = ..., room_id: _Optional[str] = ..., box_id: _Optional[str] = ...) -> None: ...

class TreasureReward(_message.Message):
    __slots__ = ("box_id", "level", "user_id", "event_id")
    BOX_ID_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    box_id: str
    level: int
    user_id: str
    event_id: str
    def __init__(self, box_id: _Optional[str] = ..., level: _Optional[int] = ..., user_id: _Optional[str] = ..., event_id: _Optional[str] = ...) -> None: ...

class TreasureRewardsReply(_message.Message):
    __slots__ = ("rewards",)
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    rewards: _containers.RepeatedCompositeFieldContainer[TreasureReward]
    def __init__(self, rewards: _Optional[_Iterable[_Union[TreasureReward, _Mapping]]] = ...) -> None: ...
