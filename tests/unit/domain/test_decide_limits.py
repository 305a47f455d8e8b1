"""SPEC §3 input limits that a decision depends on: seat_count, gift count, ban_seconds.

The HTTP edge validates request bodies, but ``decide`` is also reached from
other paths (internal commands, tests, future entrypoints) and these numbers
flow straight into state: a negative gift count would lower heat and treasure
energy, a zero-seat room could never seat anyone.
"""

from __future__ import annotations

import pytest

from roomservice import errors
from roomservice.domain import commands as c
from roomservice.domain import limits


@pytest.mark.parametrize("seat_count", [limits.SEAT_COUNT_MIN, limits.SEAT_COUNT_MAX])
def test_seat_count_at_the_limits_is_accepted(room, seat_count):
    room.create(seat_count=seat_count)
    assert room.live.seat_count == seat_count


@pytest.mark.parametrize("count", [limits.GIFT_COUNT_MIN, limits.GIFT_COUNT_MAX])
def test_gift_count_at_the_limits_is_accepted(open_room, count):
    [sent, *_] = open_room.gift("alice", "bob", "rose", count=count)
    assert sent.total_value == 10 * count


@pytest.mark.parametrize("ban_seconds", [limits.BAN_SECONDS_MIN, limits.BAN_SECONDS_MAX])
def test_ban_seconds_at_the_limits_are_accepted(open_room, ban_seconds):
    [kicked] = open_room.payloads(c.KickUser(operator_id="owner", target_id="alice", ban_seconds=ban_seconds))
    assert kicked.banned_until_ms == open_room.now_ms + ban_seconds * 1000


@pytest.mark.parametrize("seat_count", [0, -1, 21])
def test_seat_count_outside_1_to_20_is_invalid_argument(room, seat_count):
    with pytest.raises(errors.InvalidArgument):
        room.create(seat_count=seat_count)


@pytest.mark.parametrize("count", [0, -5, 10_000])
def test_gift_count_outside_1_to_9999_is_invalid_argument(open_room, count):
    with pytest.raises(errors.InvalidArgument):
        open_room.gift("alice", "bob", "rose", count=count)
    assert open_room.live.heat == 0


@pytest.mark.parametrize("ban_seconds", [0, -60, 2_592_001])
def test_ban_seconds_outside_1_to_2592000_is_invalid_argument(open_room, ban_seconds):
    with pytest.raises(errors.InvalidArgument):
        open_room.send(c.KickUser(operator_id="owner", target_id="alice", ban_seconds=ban_seconds))
    assert open_room.live.is_member("alice")


# --------------------------------------------------------------------------- titles

BIDI_CONTROLS = [chr(cp) for cp in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))]


@pytest.mark.parametrize(
    "title",
    [
        "nul\x00byte",
        "line\nbreak",
        "carriage\rreturn",
        "tab\there",
        "bell\x07",
        "del\x7f",
        "nel\x85",
        "\x1b[31mred",
        "line\u2028separator",
        *[f"evil{ch}txt" for ch in BIDI_CONTROLS],
        " ",
        "   ",
        "\u3000",  # ideographic space
        "\u00a0\u2003",  # no-break space, em space
        "",
        "t" * 65,
        "🎤" * 65,
    ],
    ids=repr,
)
def test_titles_with_control_or_bidi_characters_blank_or_too_long_are_invalid(room, title):
    with pytest.raises(errors.InvalidArgument) as raised:
        room.create(title=title)
    assert "title" in raised.value.message
    assert limits.title_problem(title) is not None


@pytest.mark.parametrize(
    "title",
    [
        "Hello 🎤",
        "👨\u200d👩\u200d👧 family",  # ZWJ sequence
        "❤\ufe0f",  # variation selector
        "\u200e\u05e9\u05dc\u05d5\u05dd",  # a left-to-right mark and Hebrew: a mark, not an override
        "  padded  ",
        "x",
        "t" * 64,
        "🎤" * 64,  # 64 code points (256 UTF-8 bytes)
        "e\u0301" * 32,  # 64 code points, 32 graphemes
    ],
    ids=repr,
)
def test_titles_with_other_format_characters_are_accepted_and_counted_in_code_points(room, title):
    room.create(title=title)
    assert room.live.title == title
    assert limits.title_problem(title) is None
