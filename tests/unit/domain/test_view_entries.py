"""The room view's member and seat entries, reused from the room's last view (issue 12), are always
what building them afresh from the state gives, and no later view changes an earlier one."""

from __future__ import annotations

import copy
import sys
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roomservice.domain import view
from roomservice.domain.state import RoomState
from roomservice.domain.view import room_view

USERS = [f"u{i}" for i in range(6)]


def _fresh(state: RoomState) -> dict[str, Any]:
    """The view's lists as the contract defines them, built from nothing."""
    return {
        "members": [
            {"user_id": u, "role": "owner" if u == state.owner_id else "member", "joined_at_ms": at}
            for u, at in state.members.items()
        ],
        "seats": [{"index": i, "user_id": holder} for i, holder in enumerate(state.seats)],
    }


def _room(room_id: str) -> RoomState:
    return RoomState(app_code="a", room_id=room_id, owner_id="u0", title="t", seat_count=3, created_at_ms=1,
                     members={"u0": 1}, seats=(None, None, None))


def _apply(state: RoomState, op: tuple[str, str, int]) -> RoomState:
    kind, user, n = op
    version = state.version + 1
    if kind == "join" and user not in state.members:
        return state.with_(version=version, members={**state.members, user: n})
    if kind == "leave":
        return state.with_(version=version, members={u: at for u, at in state.members.items() if u != user})
    if kind == "owner":
        return state.with_(version=version, owner_id=user)
    if kind == "seat":
        seats = list(state.seats)
        seats[n % len(seats)] = user
        return state.with_(version=version, seats=tuple(seats))
    if kind == "rejoined":  # the same user again with another time: a value changed, not a key added
        if user in state.members:
            return state.with_(version=version, members={**state.members, user: state.members[user] + n})
        return state
    if kind == "copy":  # the same content in new objects (a state loaded again from the store)
        return state.with_(members=dict(state.members), seats=tuple(list(state.seats)))
    if kind == "reorder":  # the same members in another order
        return state.with_(members=dict(reversed(list(state.members.items()))))
    if kind in ("retime_join", "reorder_join"):  # more members, but the ones before are not as they were
        before = list(state.members.items())
        before = [(u, at + 1) for u, at in before] if kind == "retime_join" else before[::-1]
        return state.with_(version=version, members={**dict(before), f"{user}-{n}-{version}": n})
    if kind == "handover_join":  # a new owner and a new member in one step
        return state.with_(version=version, owner_id=user, members={**state.members, f"{user}-{version}": n})
    return state.with_(version=version, heat=state.heat + n)  # "gift": nothing in the lists changes


OPS = st.tuples(st.sampled_from(["join", "leave", "owner", "seat", "rejoined", "copy", "reorder", "gift",
                                  "retime_join", "reorder_join", "handover_join"]),
                st.sampled_from(USERS), st.integers(0, 5))


def _held_as_counted() -> int:
    return sum(len(kept[2]) + len(kept[4]) for kept in view._recent.values())


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["r1", "r2", "r3"]), OPS), max_size=40),
       bound=st.sampled_from([1, 2, 256]), limit=st.sampled_from([6, 12, 100_000]))
def test_every_view_lists_what_the_state_holds(
    steps: list[tuple[str, tuple[str, str, int]]], bound: int, limit: int
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(view, "_recent", {})
        patch.setattr(view, "_held", [0])
        patch.setattr(view, "_ENTRY_ROOMS", bound)
        patch.setattr(view, "_ENTRY_LIMIT", limit)  # seats are 3 entries, members 1 to ~20
        rooms = {room_id: _room(room_id) for room_id in ("r1", "r2", "r3")}
        answered: list[tuple[dict[str, Any], dict[str, Any]]] = []
        for room_id, op in steps:
            state = rooms[room_id] = _apply(rooms[room_id], op)
            shown = room_view(state, now_ms=5, level_count=3)
            expected = _fresh(state)
            assert shown["members"] == expected["members"] and shown["seats"] == expected["seats"]
            answered.append((shown, copy.deepcopy(shown)))
            assert len(view._recent) <= bound and view._held[0] == _held_as_counted() <= limit
        for shown, as_it_was in answered:  # an answer given earlier still says what it said
            assert shown == as_it_was


def test_a_view_lists_are_its_own() -> None:
    state = _room("own")
    first = room_view(state, now_ms=5, level_count=3)
    first["members"].append({"user_id": "x"})
    first["seats"].clear()
    again = room_view(state, now_ms=5, level_count=3)
    assert again["members"] == _fresh(state)["members"] and again["seats"] == _fresh(state)["seats"]


def test_views_built_on_several_threads_at_once_are_right(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(view, "_recent", {})
    monkeypatch.setattr(view, "_held", [0])
    monkeypatch.setattr(view, "_ENTRY_ROOMS", 4)  # rooms evicted all the time, from every thread
    failures: list[BaseException] = []

    def build(worker: int) -> None:
        try:
            for n in range(2_000):
                state = _apply(_room(f"r{(worker + n) % 7}"), ("join", USERS[n % len(USERS)], n))  # rooms shared
                shown = room_view(state, now_ms=5, level_count=3)
                assert shown["members"] == _fresh(state)["members"]
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=build, args=(w,)) for w in range(8)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between almost every two bytecodes
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == [] and len(view._recent) <= 4 and view._held[0] == _held_as_counted()


def test_a_room_bigger_than_the_limit_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(view, "_recent", {})
    monkeypatch.setattr(view, "_held", [0])
    monkeypatch.setattr(view, "_ENTRY_LIMIT", 10)
    small = _room("small")
    big = _room("big").with_(members={f"m{i}": i for i in range(20)})
    assert room_view(small, now_ms=5, level_count=3)["members"] == _fresh(small)["members"]
    assert room_view(big, now_ms=5, level_count=3)["members"] == _fresh(big)["members"]
    assert list(view._recent) == [("a", "small")] and view._held[0] == 1 + 3  # one member, three seats
