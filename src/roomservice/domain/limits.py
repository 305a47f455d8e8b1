"""Input limits of SPEC §3, shared by the domain and the HTTP edge."""

from __future__ import annotations

import re

APP_CODE_PATTERN = r"^[a-z0-9_]{1,32}$"
ROOM_ID_PATTERN = r"^[A-Za-z0-9_-]{1,48}$"
ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"  # user ids, command ids, gift ids

TITLE_MIN, TITLE_MAX = 1, 64
SEAT_COUNT_MIN, SEAT_COUNT_MAX = 1, 20
GIFT_COUNT_MIN, GIFT_COUNT_MAX = 1, 9999
BAN_SECONDS_MIN, BAN_SECONDS_MAX = 1, 2_592_000
MAX_BODY_BYTES = 64 * 1024
MAX_TREASURE_RECIPIENTS = 200

_APP_CODE = re.compile(APP_CODE_PATTERN)
_ROOM_ID = re.compile(ROOM_ID_PATTERN)
_ID = re.compile(ID_PATTERN)


def valid_app_code(value: str) -> bool:
    return bool(_APP_CODE.fullmatch(value))


def valid_room_id(value: str) -> bool:
    return bool(_ROOM_ID.fullmatch(value))


def valid_id(value: str) -> bool:
    return bool(_ID.fullmatch(value))
