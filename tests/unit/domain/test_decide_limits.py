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
