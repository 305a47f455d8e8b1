"""SPEC §3: TakeMic and LeaveMic."""

from __future__ import annotations

import pytest

from roomservice import errors
from roomservice.domain import commands as c
from roomservice.domain import events as e


def test_take_mic_emits_mic_taken(open_room):
    assert open_room.payloads(c.TakeMic(user_id="alice", seat=4)) == [e.RoomMicTaken(user_id="alice", seat=4)]
    assert open_room.live.seats[4] == "alice"
    assert open_room.live.seat_of("alice") == 4


@pytest.mark.parametrize("user", ["carol", "owner-impostor"])
def test_take_mic_by_a_non_member_is_not_member(open_room, user):
    with pytest.raises(errors.NotMember) as info:
        open_room.send(c.TakeMic(user_id=user, seat=0))
    assert info.value.code == "not_member"
    assert open_room.live.seats[0] is None


def test_take_mic_by_a_former_member_is_not_member(open_room):
    open_room.send(c.LeaveRoom(user_id="alice"))
    with pytest.raises(errors.NotMember):
        open_room.send(c.TakeMic(user_id="alice", seat=0))


def test_take_mic_by_the_owner_after_leaving_is_not_member(open_room):
    open_room.send(c.LeaveRoom(user_id="owner"))
    with pytest.raises(errors.NotMember):
        open_room.send(c.TakeMic(user_id="owner", seat=0))


@pytest.mark.parametrize("seat", [-1, 8, 9, 20, 1_000_000])
def test_take_mic_seat_out_of_range_is_invalid_argument(open_room, seat):
    with pytest.raises(errors.InvalidArgument) as info:
        open_room.send(c.TakeMic(user_id="alice", seat=seat))
    assert info.value.code == "invalid_argument"
    assert open_room.live.seat_of("alice") is None


@pytest.mark.parametrize("seat_count", [1, 3, 20])
def test_seat_range_follows_the_room_seat_count(room, seat_count):
    room.create(seat_count=seat_count)
    room.send(c.TakeMic(user_id="owner", seat=seat_count - 1))
    assert room.live.seats[-1] == "owner"
    with pytest.raises(errors.InvalidArgument):
        room.send(c.TakeMic(user_id="owner", seat=seat_count))


def test_take_mic_on_a_seat_held_by_another_is_seat_taken(open_room):
    open_room.send(c.TakeMic(user_id="alice", seat=2))
    with pytest.raises(errors.SeatTaken) as info:
        open_room.send(c.TakeMic(user_id="bob", seat=2))
    assert info.value.code == "seat_taken"
    assert open_room.live.seats[2] == "alice"
    assert open_room.live.seat_of("bob") is None


def test_seat_taken_does_not_move_a_seated_user(open_room):
    open_room.send(c.TakeMic(user_id="alice", seat=2))
    open_room.send(c.TakeMic(user_id="bob", seat=5))
    with pytest.raises(errors.SeatTaken):
        open_room.send(c.TakeMic(user_id="bob", seat=2))
    assert open_room.live.seats[5] == "bob"


def test_take_mic_on_your_own_seat_is_a_no_op(open_room):
    open_room.send(c.TakeMic(user_id="alice", seat=2))
    before = open_room.live
    assert open_room.send(c.TakeMic(user_id="alice", seat=2)) == []
    assert open_room.live == before


def test_take_mic_on_another_seat_moves(open_room):
    open_room.send(c.TakeMic(user_id="alice", seat=2))
    assert open_room.payloads(c.TakeMic(user_id="alice", seat=6)) == [
        e.RoomMicLeft(user_id="alice", seat=2),
        e.RoomMicTaken(user_id="alice", seat=6),
    ]
    assert open_room.live.seats[2] is None
    assert open_room.live.seats[6] == "alice"
    assert [s for s in open_room.live.seats if s == "alice"] == ["alice"]


def test_a_freed_seat_can_be_taken_by_another(open_room):
    open_room.send(c.TakeMic(user_id="alice", seat=2))
    open_room.send(c.TakeMic(user_id="alice", seat=3))
    assert open_room.payloads(c.TakeMic(user_id="bob", seat=2)) == [e.RoomMicTaken(user_id="bob", seat=2)]


def test_leave_mic_emits_mic_left(open_room):
    open_room.send(c.TakeMic(user_id="bob", seat=7))
    assert open_room.payloads(c.LeaveMic(user_id="bob")) == [e.RoomMicLeft(user_id="bob", seat=7)]
    assert open_room.live.seats == (None,) * 8


@pytest.mark.parametrize("user", ["alice", "carol"])
def test_leave_mic_when_not_seated_is_a_no_op(open_room, user):
    before = open_room.live
    assert open_room.send(c.LeaveMic(user_id=user)) == []
    assert open_room.live == before
