"""The room view of the HTTP contract, computed from state at read time."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from itertools import islice
from typing import Any, Final

from roomservice.domain.state import RoomState, utc_day

IDLE = "idle"
COUNTING_DOWN = "counting_down"
COMPLETED = "completed"


def room_view(state: RoomState, *, now_ms: int, level_count: int) -> dict[str, Any]:
    """The room as clients see it; the treasure is shown after today's UTC reset."""
    treasure = state.treasure.on_day(utc_day(now_ms))
    box = treasure.box
    if box is not None:
        treasure_state = COUNTING_DOWN
    elif treasure.opened >= level_count:
        treasure_state = COMPLETED
    else:
        treasure_state = IDLE
    members, seats = _entries(state)
    return {
        "app_code": state.app_code,
        "room_id": state.room_id,
        "version": state.version,
        "owner_id": state.owner_id,
        "title": state.title,
        "status": state.status,
        "members": members,
        "seats": seats,
        "heat": state.heat,
        "treasure": {
            "energy": treasure.energy,
            "level": treasure.opened,
            "box_id": None if box is None else box.box_id,
            "state": treasure_state,
            "open_at_ms": None if box is None else box.open_at_ms,
        },
    }


# The view's member and seat entries of recently answered rooms (issue 12): every command answers
# the whole room, and building an entry a member was ~40 % of a join's answer in a room of 30. A
# state's members and seats are never changed in place, and a join appends one member, so
# entries built for one state serve the next: the same dict (a gift, a mic) or one that starts
# with the same members (a join). Entry dicts are shared by the answers that list them; an answer
# is never changed once built (store.port.Answer). Bounded: the rooms answered most recently.
_ENTRY_ROOMS: Final = 256
Entries = list[dict[str, Any]]
_recent: dict[tuple[str, str], tuple[dict[str, int], str, Entries, tuple[str | None, ...], Entries]] = {}
_recent_lock = threading.Lock()  # views are built on event loops, but nothing stops two threads


def _entries(state: RoomState) -> tuple[Entries, Entries]:
    """New lists of the view's member and seat entries, sharing the entries still the same."""
    key = (state.app_code, state.room_id)
    members, owner_id, seats = state.members, state.owner_id, state.seats
    with _recent_lock:
        cached = _recent.pop(key, None)  # put back below, as the room answered last
    if cached is None:
        member_entries, seat_entries = _member_entries(members.items(), owner_id), _seat_entries(seats)
    else:
        known, known_owner, member_entries, known_seats, seat_entries = cached
        if known is not members:
            shared = len(known)
            if (known_owner == owner_id and len(members) > shared and list(members)[:shared] == list(known)
                    and known.items() <= members.items()):  # the same members in the same order, then more
                member_entries = member_entries + _member_entries(islice(members.items(), shared, None), owner_id)
            else:
                member_entries = _member_entries(members.items(), owner_id)
        elif known_owner != owner_id:
            member_entries = _member_entries(members.items(), owner_id)
        if known_seats is not seats:
            seat_entries = _seat_entries(seats)
    with _recent_lock:
        while len(_recent) >= _ENTRY_ROOMS:
            del _recent[next(iter(_recent))]  # the room answered longest ago
        _recent[key] = (members, owner_id, member_entries, seats, seat_entries)
    return list(member_entries), list(seat_entries)


def _member_entries(members: Iterable[tuple[str, int]], owner_id: str) -> Entries:
    return [
        {"user_id": user_id, "role": "owner" if user_id == owner_id else "member", "joined_at_ms": joined_at}
        for user_id, joined_at in members
    ]


def _seat_entries(seats: tuple[str | None, ...]) -> Entries:
    return [{"index": i, "user_id": holder} for i, holder in enumerate(seats)]
