"""SPEC §3: KickUser (owner only, bans) and CloseRoom."""

from __future__ import annotations

import pytest

from roomservice import errors
from roomservice.domain import commands as c
from roomservice.domain import events as e
from roomservice.domain.rules import RoomRules
from roomservice.domain.state import CLOSED

# ----------------------------------------------------------------------------- kick


@pytest.mark.parametrize("operator", ["alice", "carol"])
def test_kick_by_anyone_but_the_owner_is_not_allowed(open_room, operator):
    with pytest.raises(errors.NotAllowed) as info:
        open_room.send(c.KickUser(operator_id=operator, target_id="bob"))
    assert info.value.code == "not_allowed"
    assert open_room.live.is_member("bob")


def test_the_owner_cannot_be_kicked(open_room):
    with pytest.raises(errors.NotAllowed):
        open_room.send(c.KickUser(operator_id="owner", target_id="owner"))
    with pytest.raises(errors.NotAllowed):
        open_room.send(c.KickUser(operator_id="alice", target_id="owner"))
    assert open_room.live.is_member("owner")


def test_the_absent_owner_cannot_be_kicked_either(open_room):
    open_room.send(c.LeaveRoom(user_id="owner"))
    with pytest.raises(errors.NotAllowed):
        open_room.send(c.KickUser(operator_id="owner", target_id="owner"))


def test_kick_of_a_non_member_is_not_member(open_room):
    with pytest.raises(errors.NotMember) as info:
        open_room.send(c.KickUser(operator_id="owner", target_id="carol"))
    assert info.value.code == "not_member"
    assert open_room.live.bans == {}


def test_kick_of_an_unseated_member(open_room):
    assert open_room.payloads(c.KickUser(operator_id="owner", target_id="alice")) == [
        e.RoomUserKicked(
            operator_id="owner",
            target_id="alice",
            ban_seconds=600,
            banned_until_ms=open_room.now_ms + 600_000,
        )
    ]
    s = open_room.live
    assert not s.is_member("alice")
    assert s.bans == {"alice": open_room.now_ms + 600_000}
    assert s.banned_until("alice", open_room.now_ms) == open_room.now_ms + 600_000


def test_kicked_seated_user_leaves_the_seat_first(open_room):
    open_room.send(c.TakeMic(user_id="bob", seat=5))
    payloads = open_room.payloads(c.KickUser(operator_id="owner", target_id="bob", ban_seconds=3600))
    assert payloads == [
        e.RoomMicLeft(user_id="bob", seat=5),
        e.RoomUserKicked(
            operator_id="owner", target_id="bob", ban_seconds=3600, banned_until_ms=open_room.now_ms + 3_600_000
        ),
    ]
    assert open_room.live.seats[5] is None
    assert not open_room.live.is_member("bob")


def test_default_ban_comes_from_the_rules(make_room):
    r = make_room(rules=RoomRules(default_ban_seconds=42))
    r.create()
    r.join("alice")
    [kicked] = r.payloads(c.KickUser(operator_id="owner", target_id="alice"))
    assert (kicked.ban_seconds, kicked.banned_until_ms) == (42, r.now_ms + 42_000)


def test_kicked_user_is_banned_until_the_ban_ends(open_room):
    open_room.send(c.KickUser(operator_id="owner", target_id="alice", ban_seconds=10))
    with pytest.raises(errors.UserBanned):
        open_room.send(c.JoinRoom(user_id="alice"))
    open_room.advance(9_999)
    with pytest.raises(errors.UserBanned):
        open_room.send(c.JoinRoom(user_id="alice"))
    open_room.advance(1)
    open_room.send(c.JoinRoom(user_id="alice"))
    assert open_room.live.is_member("alice")


def test_a_rekick_after_rejoin_sets_a_new_ban(open_room):
    open_room.send(c.KickUser(operator_id="owner", target_id="alice", ban_seconds=1))
    open_room.advance(1_000)
    open_room.send(c.JoinRoom(user_id="alice"))
    open_room.send(c.KickUser(operator_id="owner", target_id="alice", ban_seconds=5))
    assert open_room.live.bans["alice"] == open_room.now_ms + 5_000


def test_kicked_user_can_neither_take_mic_nor_gift(open_room):
    open_room.send(c.KickUser(operator_id="owner", target_id="alice"))
    with pytest.raises(errors.NotMember):
        open_room.send(c.TakeMic(user_id="alice", seat=0))
    with pytest.raises(errors.NotMember):
        open_room.gift("alice", "bob", "rose")
    with pytest.raises(errors.NotMember):
        open_room.send(c.KickUser(operator_id="owner", target_id="alice"))


# ----------------------------------------------------------------------------- close


@pytest.mark.parametrize("operator", ["alice", "carol"])
def test_close_by_anyone_but_the_owner_is_not_allowed(open_room, operator):
    with pytest.raises(errors.NotAllowed) as info:
        open_room.send(c.CloseRoom(operator_id=operator))
    assert info.value.code == "not_allowed"
    assert open_room.live.status == "open"


def test_owner_closes_the_room(open_room):
    v = open_room.version
    [event] = open_room.send(c.CloseRoom(operator_id="owner"))
    assert event.payload == e.RoomClosed(operator_id="owner")
    assert event.room_version == v + 1
    assert open_room.live.status == CLOSED


def test_closing_twice_is_room_closed(open_room):
    open_room.send(c.CloseRoom(operator_id="owner"))
    with pytest.raises(errors.RoomClosed):
        open_room.send(c.CloseRoom(operator_id="owner"))
