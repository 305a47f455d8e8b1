"""The hand-written hot-path helpers (issue 12) give what the library calls they replace give."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from roomservice.domain.state import CLOSED, RoomState, TreasureState
from roomservice.domain.view import room_view
from roomservice.service import new_event_id


def test_an_event_id_is_a_random_uuid4_in_hex() -> None:
    ids = {new_event_id() for _ in range(2_000)}
    assert len(ids) == 2_000
    for event_id in ids:
        parsed = uuid.UUID(hex=event_id)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122 and parsed.hex == event_id


@pytest.mark.parametrize("raw", [bytes(16), b"\xff" * 16, bytes(range(16)), bytes(range(240, 256))])
def test_an_event_id_is_uuid4_of_the_random_bytes(raw: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("roomservice.service.os.urandom", lambda n: raw[:n])
    assert new_event_id() == uuid.UUID(bytes=raw, version=4).hex


def _state() -> RoomState:
    return RoomState(
        app_code="a", room_id="r", owner_id="o", title="t", seat_count=2, created_at_ms=1, version=3,
        members={"o": 1, "u": 2}, seats=("u", None), bans={"b": 9}, heat=5, treasure=TreasureState(day=1, energy=2),
    )


@pytest.mark.parametrize(
    "changes",
    [{}, {"version": 4}, {"members": {"o": 1}, "version": 4, "bans": {}}, {"status": CLOSED, "heat": 0, "seats": ()}],
)
def test_with_is_dataclasses_replace(changes: dict[str, object]) -> None:
    state = _state()
    changed = state.with_(**changes)
    assert changed == dataclasses.replace(state, **changes)  # type: ignore[arg-type]
    assert changed is not state
    assert state == _state()  # the original is untouched


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(RoomState)])
def test_with_copies_every_field_and_changes_the_one_named(name: str) -> None:
    state, marker = _state(), object()
    changed = state.with_(**{name: marker})
    for f in dataclasses.fields(RoomState):
        assert getattr(changed, f.name) is (marker if f.name == name else getattr(state, f.name))


def test_with_refuses_a_field_the_state_does_not_have() -> None:
    with pytest.raises(TypeError, match="'colour'"):
        _state().with_(version=4, colour="red")


def test_the_view_names_the_owner_and_the_members() -> None:
    roles = [(m["user_id"], m["role"]) for m in room_view(_state(), now_ms=1, level_count=3)["members"]]
    assert roles == [("o", "owner"), ("u", "member")]
