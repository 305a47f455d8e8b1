"""SPEC §3 / §8: the room view computed from state at read time."""

from __future__ import annotations

from roomservice.domain import commands as c
from roomservice.domain.view import room_view

LEVELS = 3


def view(r, now_ms=None):
    return room_view(r.live, now_ms=r.now_ms if now_ms is None else now_ms, level_count=LEVELS)


def test_view_of_a_fresh_room(room):
    room.create(title="Hello", seat_count=2)
    assert view(room) == {
        "app_code": room.APP,
        "room_id": room.ROOM,
        "version": 1,
        "owner_id": "owner",
        "title": "Hello",
        "status": "open",
        "members": [{"user_id": "owner", "role": "owner", "joined_at_ms": room.NOON_MS}],
        "seats": [{"index": 0, "user_id": None}, {"index": 1, "user_id": None}],
        "heat": 0,
        "treasure": {"energy": 0, "level": 0, "box_id": None, "state": "idle", "open_at_ms": None},
    }


def test_view_lists_members_in_join_order_with_roles_and_seats(open_room):
    open_room.send(c.LeaveRoom(user_id="owner"))
    open_room.advance(10)
    open_room.join("owner")
    open_room.send(c.TakeMic(user_id="bob", seat=1))
    v = view(open_room)
    assert [(m["user_id"], m["role"]) for m in v["members"]] == [
        ("alice", "member"),
        ("bob", "member"),
        ("owner", "owner"),
    ]
    assert v["members"][-1]["joined_at_ms"] == open_room.NOON_MS + 10
    assert v["seats"][1] == {"index": 1, "user_id": "bob"}
    assert [s["index"] for s in v["seats"]] == list(range(8))
    assert v["version"] == open_room.live.version


def test_view_treasure_states(open_room):
    open_room.gift("alice", "bob", "heart")
    assert view(open_room)["treasure"]["state"] == "idle"
    open_room.gift("alice", "bob", "castle", count=10)
    t = view(open_room)["treasure"]
    assert (t["state"], t["level"], t["energy"], t["box_id"]) == ("counting_down", 0, 50_100, f"{open_room.DAY1}-1")
    assert t["open_at_ms"] == open_room.now_ms + 60_000
    for _ in range(3):
        open_room.open_box()
    t = view(open_room)["treasure"]
    assert t == {"energy": 50_100, "level": 3, "box_id": None, "state": "completed", "open_at_ms": None}
    assert view(open_room)["heat"] == 50_100


def test_view_shows_the_utc_reset_without_a_new_event(open_room):
    open_room.gift("alice", "bob", "castle", count=10)
    for _ in range(3):
        open_room.open_box()
    v = open_room.live.version
    t = view(open_room, now_ms=open_room.MIDNIGHT_MS)["treasure"]
    assert t == {"energy": 0, "level": 0, "box_id": None, "state": "idle", "open_at_ms": None}
    assert view(open_room, now_ms=open_room.MIDNIGHT_MS - 1)["treasure"]["state"] == "completed"
    assert open_room.live.version == v  # reading never changes the room


def test_view_of_a_closed_room(open_room):
    open_room.send(c.CloseRoom(operator_id="owner"))
    assert view(open_room)["status"] == "closed"
