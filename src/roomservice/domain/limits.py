"""Input limits of SPEC §3, shared by the domain and the HTTP edge."""

from __future__ import annotations

import re
import unicodedata

APP_CODE_PATTERN = r"^[a-z0-9_]{1,32}$"
ROOM_ID_PATTERN = r"^[A-Za-z0-9_-]{1,48}$"
ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"  # user ids, command ids, gift ids

TITLE_MIN, TITLE_MAX = 1, 64  # code points
SEAT_COUNT_MIN, SEAT_COUNT_MAX = 1, 20
GIFT_COUNT_MIN, GIFT_COUNT_MAX = 1, 9999
BAN_SECONDS_MIN, BAN_SECONDS_MAX = 1, 2_592_000
MAX_BODY_BYTES = 64 * 1024
MAX_TREASURE_RECIPIENTS = 200
MAX_ID_VALUE = 2**63 - 1  # numeric ids and cursors: a signed 64-bit column on every backend

# Titles reach the IM group name and every client's screen. Refused: control
# characters (Unicode Cc: NUL, CR/LF, ESC...), line and paragraph separators,
# and the bidi embeddings, overrides and isolates that reorder the text around
# them (U+202A-U+202E, U+2066-U+2069). Other format characters (Cf: the ZWJ of
# emoji sequences, variation selectors, LRM/RLM marks) stay allowed.
_BIDI_CONTROLS = frozenset(chr(cp) for cp in (*range(0x202A, 0x202F), *range(0x2066, 0x206A)))
_REFUSED_CATEGORIES = frozenset({"Cc", "Zl", "Zp"})

_APP_CODE = re.compile(APP_CODE_PATTERN)
_ROOM_ID = re.compile(ROOM_ID_PATTERN)
_ID = re.compile(ID_PATTERN)


def valid_app_code(value: str) -> bool:
    return bool(_APP_CODE.fullmatch(value))


def valid_room_id(value: str) -> bool:
    return bool(_ROOM_ID.fullmatch(value))


def valid_id(value: str) -> bool:
    return bool(_ID.fullmatch(value))


def title_problem(title: str) -> str | None:
    """What is wrong with ``title`` (``None``: nothing). Lengths count code points, as SPEC §3 does."""
    if not TITLE_MIN <= len(title) <= TITLE_MAX:
        return f"title must be {TITLE_MIN}-{TITLE_MAX} characters, got {len(title)}"
    if title.isspace():
        return "title must not be blank"
    for index, char in enumerate(title):
        if char in _BIDI_CONTROLS:
            return f"title must not contain the bidi control U+{ord(char):04X} (at character {index})"
        if unicodedata.category(char) in _REFUSED_CATEGORIES:
            return f"title must not contain the control character U+{ord(char):04X} (at character {index})"
    return None
