"""The room view of the HTTP contract, computed from state at read time."""

from __future__ import annotations

from typing import Any

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
    owner_id = state.owner_id  # RoomState.role_of, inline: it runs once per member of every answer
    return {
        "app_code": state.app_code,
        "room_id": state.room_id,
        "version": state.version,
        "owner_id": state.owner_id,
        "title": state.title,
        "status": state.status,
        "members": [
            {"user_id": user_id, "role": "owner" if user_id == owner_id else "member", "joined_at_ms": joined_at}
            for user_id, joined_at in state.members.items()
        ],
        "seats": [{"index": i, "user_id": holder} for i, holder in enumerate(state.seats)],
        "heat": state.heat,
        "treasure": {
            "energy": treasure.energy,
            "level": treasure.opened,
            "box_id": None if box is None else box.box_id,
            "state": treasure_state,
            "open_at_ms": None if box is None else box.open_at_ms,
        },
    }
