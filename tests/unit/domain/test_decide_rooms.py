"""SPEC §3: creating, joining and leaving rooms; versions and event envelopes."""

from __future__ import annotations

import dataclasses

import pytest

from roomservice import errors
from roomservice.domain import commands as c
from roomservice.domain import events as e
from roomservice.domain.decider import decide, evolve, replay, stamp
from roomservice.domain.rules import RoomRules
from roomservice.domain.state import CLOSED, OPEN, RoomState

# ----------------------------------------------------------------------------- create


def test_create_emits_room_created_with_default_seat_count(room):
    [event] = room.create(owner="owner", title="Friday night")

    assert event.payload == e.RoomCreated(owner_id="owner", title="Friday night", seat_count=8)
    s = room.live
    assert (s.owner_id, s.title, s.status, s.version) == ("owner", "Friday night", OPEN, 1)
    assert s.seat_count == 8
    assert s.seats == (None,) * 8
    assert list(s.members) == ["owner"]
    assert s.role_of("owner") == "owner"
    assert s.heat == 0
    assert s.bans == {}
    assert s.created_at_ms == room.NOON_MS


def test_create_uses_the_configured_default_seat_count(make_room):
    r = make_room(rules=RoomRules(default_seat_count=12))
    [event] = r.create()
    assert event.payload.seat_count == 12
    assert len(r.live.seats) == 12


@pytest.mark.parametrize("seat_count", [1, 5, 20])
def test_create_with_explicit_seat_count(room, seat_count):
    room.create(seat_count=seat_count)
    assert room.live.seat_count == seat_count
    assert room.live.seats == (None,) * seat_count


def test_create_twice_is_room_exists(open_room):
    before = open_room.live
    with pytest.raises(errors.RoomExists) as info:
        open_room.send(c.CreateRoom(owner_id="someone", title="again"))
    assert info.value.code == "room_exists"
    assert open_room.live == before


def test_create_on_a_closed_room_is_room_exists_not_room_closed(open_room):
    open_room.send(c.CloseRoom(operator_id="owner"))
    with pytest.raises(errors.RoomExists):
        open_room.send(c.CreateRoom(owner_id="owner", title="reopen"))
    assert open_room.live.status == CLOSED


# ----------------------------------------------------------------------------- not found

CLIENT_COMMANDS_ON_MISSING_ROOM = [
    c.JoinRoom(user_id="alice"),
    c.LeaveRoom(user_id="alice"),
    c.TakeMic(user_id="alice", seat=0),
    c.LeaveMic(user_id="alice"),
    c.SendGift(sender_id="alice", receiver_id="owner", gift_id="rose", count=1),
    c.KickUser(operator_id="owner", target_id="alice"),
    c.CloseRoom(operator_id="owner"),
]


@pytest.mark.parametrize("command", CLIENT_COMMANDS_ON_MISSING_ROOM, ids=lambda cmd: cmd.name)
def test_every_command_but_create_on_a_missing_room_is_room_not_found(room, command):
    with pytest.raises(errors.RoomNotFound) as info:
        room.send(command)
    assert info.value.code == "room_not_found"
    assert room.state is None


# ----------------------------------------------------------------------------- closed

CLIENT_COMMANDS_ON_CLOSED_ROOM = [
    c.JoinRoom(user_id="carol"),  # would join
    c.JoinRoom(user_id="alice"),  # would be a no-op
    c.LeaveRoom(user_id="alice"),  # would leave
    c.LeaveRoom(user_id="carol"),  # would be a no-op
    c.TakeMic(user_id="alice", seat=1),
    c.TakeMic(user_id="bob", seat=0),  # bob's own seat: would be a no-op
    c.TakeMic(user_id="alice", seat=99),  # would be invalid_argument
    c.LeaveMic(user_id="bob"),
    c.LeaveMic(user_id="alice"),  # not seated: would be a no-op
    c.SendGift(sender_id="alice", receiver_id="bob", gift_id="rose", count=1),
    c.SendGift(sender_id="alice", receiver_id="bob", gift_id="nope", count=1),
    c.KickUser(operator_id="owner", target_id="alice"),
    c.KickUser(operator_id="alice", target_id="bob"),
    c.CloseRoom(operator_id="owner"),
    c.CloseRoom(operator_id="alice"),
]


@pytest.mark.parametrize(
    "command", CLIENT_COMMANDS_ON_CLOSED_ROOM, ids=lambda cmd: "-".join(map(str, cmd.to_dict().values()))
)
def test_every_client_command_after_close_is_room_closed(open_room, command):
    open_room.send(c.TakeMic(user_id="bob", seat=0))
    open_room.send(c.CloseRoom(operator_id="owner"))
    before = open_room.live
    with pytest.raises(errors.RoomClosed) as info:
        open_room.send(command)
    assert info.value.code == "room_closed"
    assert open_room.live == before


# ----------------------------------------------------------------------------- join


def test_join_emits_user_joined_as_member(open_room):
    assert open_room.payloads(c.JoinRoom(user_id="carol")) == [e.RoomUserJoined(user_id="carol", role="member")]
    assert list(open_room.live.members) == ["owner", "alice", "bob", "carol"]
    assert open_room.live.members["carol"] == open_room.now_ms


@pytest.mark.parametrize("user", ["owner", "alice"])
def test_join_when_already_member_is_a_no_op(open_room, user):
    before = open_room.live
    assert open_room.send(c.JoinRoom(user_id=user)) == []
    assert open_room.live == before


def test_members_keep_join_order_and_a_rejoin_goes_last(open_room):
    open_room.send(c.LeaveRoom(user_id="alice"))
    open_room.advance(1000)
    open_room.send(c.JoinRoom(user_id="alice"))
    assert list(open_room.live.members) == ["owner", "bob", "alice"]
    assert open_room.live.members["alice"] == open_room.now_ms


def test_banned_user_cannot_join(open_room):
    open_room.send(c.KickUser(operator_id="owner", target_id="alice"))
    open_room.advance(599_999)
    with pytest.raises(errors.UserBanned) as info:
        open_room.send(c.JoinRoom(user_id="alice"))
    assert info.value.code == "user_banned"
    assert not open_room.live.is_member("alice")


def test_ban_expiry_allows_rejoin_and_clears_the_ban(open_room):
    open_room.send(c.KickUser(operator_id="owner", target_id="alice", ban_seconds=30))
    open_room.advance(30_000)  # banned until exactly now: the ban is over
    assert open_room.payloads(c.JoinRoom(user_id="alice")) == [e.RoomUserJoined(user_id="alice", role="member")]
    assert open_room.live.is_member("alice")
    assert "alice" not in open_room.live.bans


def test_a_ban_does_not_affect_other_users(open_room):
    open_room.send(c.KickUser(operator_id="owner", target_id="alice"))
    assert open_room.payloads(c.JoinRoom(user_id="carol")) == [e.RoomUserJoined(user_id="carol", role="member")]


# ----------------------------------------------------------------------------- leave


def test_leave_when_not_a_member_is_a_no_op(open_room):
    before = open_room.live
    assert open_room.send(c.LeaveRoom(user_id="carol")) == []
    assert open_room.live == before


def test_leave_unseated_emits_user_left(open_room):
    assert open_room.payloads(c.LeaveRoom(user_id="alice")) == [e.RoomUserLeft(user_id="alice")]
    assert not open_room.live.is_member("alice")


def test_leave_while_seated_emits_mic_left_then_user_left(open_room):
    open_room.send(c.TakeMic(user_id="alice", seat=3))
    assert open_room.payloads(c.LeaveRoom(user_id="alice")) == [
        e.RoomMicLeft(user_id="alice", seat=3),
        e.RoomUserLeft(user_id="alice"),
    ]
    assert open_room.live.seats[3] is None
    assert open_room.live.seat_of("alice") is None
    assert not open_room.live.is_member("alice")


def test_owner_may_leave_and_stays_owner(open_room):
    open_room.send(c.TakeMic(user_id="owner", seat=0))
    assert open_room.payloads(c.LeaveRoom(user_id="owner")) == [
        e.RoomMicLeft(user_id="owner", seat=0),
        e.RoomUserLeft(user_id="owner"),
    ]
    s = open_room.live
    assert (s.owner_id, s.is_member("owner"), s.status) == ("owner", False, OPEN)


def test_owner_rejoins_with_role_owner(open_room):
    open_room.send(c.LeaveRoom(user_id="owner"))
    assert open_room.payloads(c.JoinRoom(user_id="owner")) == [e.RoomUserJoined(user_id="owner", role="owner")]
    assert open_room.live.owner_id == "owner"
    assert list(open_room.live.members) == ["alice", "bob", "owner"]


def test_absent_owner_keeps_owner_powers(open_room):
    open_room.send(c.LeaveRoom(user_id="owner"))
    assert [p.type for p in open_room.payloads(c.KickUser(operator_id="owner", target_id="alice"))] == [
        "RoomUserKicked"
    ]
    assert open_room.payloads(c.CloseRoom(operator_id="owner")) == [e.RoomClosed(operator_id="owner")]


# ----------------------------------------------------------------------------- versions and envelopes


def test_version_starts_at_one_and_rises_by_one_per_state_changing_command(room):
    room.create()
    assert room.version == 1
    room.join("alice")
    assert room.version == 2
    room.send(c.TakeMic(user_id="alice", seat=0))
    assert room.version == 3
    room.send(c.TakeMic(user_id="alice", seat=1))  # two events, one command
    assert room.version == 4
    room.send(c.LeaveRoom(user_id="alice"))  # two events, one command
    assert room.version == 5
    assert [ev.room_version for ev in room.log] == [1, 2, 3, 4, 4, 5, 5]


def test_no_ops_and_errors_keep_the_version(open_room):
    v = open_room.version
    open_room.send(c.JoinRoom(user_id="alice"))
    open_room.send(c.LeaveRoom(user_id="carol"))
    open_room.send(c.LeaveMic(user_id="alice"))
    with pytest.raises(errors.DomainError):
        open_room.send(c.TakeMic(user_id="carol", seat=0))
    assert open_room.version == v


def test_events_carry_the_envelope_fields(open_room):
    open_room.advance(1234)
    open_room.send(c.TakeMic(user_id="alice", seat=2))
    events = open_room.send(c.LeaveRoom(user_id="alice"))
    assert [ev.type for ev in events] == ["RoomMicLeft", "RoomUserLeft"]
    for ev in events:
        assert ev.app_code == open_room.APP
        assert ev.room_id == open_room.ROOM
        assert ev.room_version == open_room.live.version
        assert ev.occurred_at_ms == open_room.now_ms
    ids = [ev.event_id for ev in open_room.log]
    assert len(set(ids)) == len(ids)


def test_stamp_numbers_from_the_state_version():
    payloads = [e.RoomCreated(owner_id="o", title="t", seat_count=2)]
    ids = iter(["a", "b", "c"])
    [created] = stamp(payloads, state=None, app_code="x", room_id="r", now_ms=5, new_event_id=lambda: next(ids))
    assert (created.event_id, created.room_version, created.occurred_at_ms) == ("a", 1, 5)
    state = evolve(None, created)
    events = stamp(
        [e.RoomUserJoined(user_id="u", role="member"), e.RoomUserLeft(user_id="u")],
        state=state,
        app_code="x",
        room_id="r",
        now_ms=9,
        new_event_id=lambda: next(ids),
    )
    assert [(ev.event_id, ev.room_version) for ev in events] == [("b", 2), ("c", 2)]


def test_evolve_requires_room_created_first():
    event = e.Event("id", "x", "r", 1, 0, e.RoomUserJoined(user_id="u", role="member"))
    with pytest.raises(ValueError, match="before RoomCreated"):
        evolve(None, event)


def test_replay_rebuilds_the_live_state(open_room):
    open_room.send(c.TakeMic(user_id="alice", seat=0))
    open_room.gift("alice", "bob", "rocket")
    open_room.send(c.KickUser(operator_id="owner", target_id="alice"))
    assert replay(None, open_room.log).to_dict() == open_room.live.to_dict()


def test_state_round_trips_through_dict(open_room):
    open_room.send(c.TakeMic(user_id="alice", seat=0))
    open_room.gift("alice", "bob", "rocket")
    open_room.send(c.KickUser(operator_id="owner", target_id="bob"))
    s = open_room.live
    assert s.treasure.box is not None
    assert RoomState.from_dict(s.to_dict()) == s
    assert RoomState.from_dict(s.to_dict()).to_dict() == s.to_dict()


def test_decide_never_mutates_its_input(open_room):
    before = open_room.live.to_dict()
    decide(
        open_room.live,
        c.SendGift(sender_id="alice", receiver_id="bob", gift_id="castle", count=5),
        now_ms=open_room.now_ms,
        rules=open_room.rules,
    )
    decide(open_room.live, c.KickUser(operator_id="owner", target_id="alice"), now_ms=0, rules=open_room.rules)
    assert open_room.live.to_dict() == before


def test_unknown_command_type_is_invalid_argument(open_room):
    @dataclasses.dataclass(frozen=True)
    class Dance(c.Command):
        name = "Dance"

    with pytest.raises(errors.InvalidArgument):
        open_room.send(Dance())


def test_commands_round_trip_through_dict():
    for cmd in [*CLIENT_COMMANDS_ON_CLOSED_ROOM, c.CreateRoom(owner_id="o", title="t"), c.OpenTreasure("b", 1, 2)]:
        assert c.command_from_dict(cmd.to_dict()) == cmd
