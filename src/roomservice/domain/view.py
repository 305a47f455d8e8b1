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
# is never changed once built (store.port.Answer). Bounded: the rooms answered most recently, at
# most _ENTRY_ROOMS of them and _ENTRY_LIMIT entries in all (~250 bytes an entry; a room with more
# members than that is not kept).
_ENTRY_ROOMS: Final = 256
_ENTRY_LIMIT: Final = 100_000
Entries = list[dict[str, Any]]
Kept = tuple[dict[str, int], str, Entries, tuple[str | None, ...], Entries]
_recent: dict[tuple[str, str], Kept] = {}
_held = [0]  # entries in _recent, member and seat
_recent_lock = threading.Lock()  # views are built on event loops, but nothing stops two threads


def _entries(state: RoomState) -> tuple[Entries, Entries]:
    """New lists of the view's member and seat entries, sharing the entries still the same."""
    key = (state.app_code, state.room_id)
    members, owner_id, seats = state.members, state.owner_id, state.seats
    cached = _take(key)
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
    _keep(key, (members, owner_id, member_entries, seats, seat_entries))
    return list(member_entries), list(seat_entries)


def _take(key: tuple[str, str]) -> Kept | None:
    """The entries kept for the room ``key``, taken out (put back by :func:`_keep` once used)."""
    with _recent_lock:
        kept = _recent.pop(key, None)
        if kept is not None:
            _held[0] -= _size(kept)
    return kept


def _keep(key: tuple[str, str], kept: Kept) -> None:
    """Keep ``kept`` as the room answered last, the rooms answered longest ago dropped to stay in bounds."""
    size = _size(kept)
    if size > _ENTRY_LIMIT:
        return
    with _recent_lock:
        replaced = _recent.pop(key, None)  # kept meanwhile by a view of the room on another thread
        if replaced is not None:
            _held[0] -= _size(replaced)
        while _recent and (len(_recent) >= _ENTRY_ROOMS or _held[0] + size > _ENTRY_LIMIT):
            _held[0] -= _size(_recent.pop(next(iter(_recent))))
        _recent[key] = kept
        _held[0] += size


def _size(kept: Kept) -> int:
    """The entries ``kept`` holds: its members' and its seats'."""
    return len(kept[2]) + len(kept[4])


def _member_entries(members: Iterable[tuple[str, int]], owner_id: str) -> Entries:
    return [
        {"user_id": user_id, "role": "owner" if user_id == owner_id else "member", "joined_at_ms": joined_at}
        for user_id, joined_at in members
    ]


def _seat_entries(seats: tuple[str | None, ...]) -> Entries:
    return [{"index": i, "user_id": holder} for i, holder in enumerate(seats)]
