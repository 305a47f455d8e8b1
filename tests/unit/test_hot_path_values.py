"""The hand-written hot-path helpers (issue 12) give what the library calls they replace give."""

from __future__ import annotations

import dataclasses
import time
import uuid

import pytest

from roomservice.domain.events import new_event_id
from roomservice.domain.state import CLOSED, RoomState, TreasureState
from roomservice.domain.view import room_view


def test_an_event_id_is_a_uuid7_in_hex_of_its_millisecond() -> None:
    before = time.time_ns() // 1_000_000
    ids = [new_event_id() for _ in range(2_000)]
    after = time.time_ns() // 1_000_000
    assert len(set(ids)) == 2_000
    for event_id in ids:
        parsed = uuid.UUID(hex=event_id)
        assert parsed.version == 7 and parsed.variant == uuid.RFC_4122 and parsed.hex == event_id
        assert before <= int(event_id[:12], 16) <= after  # RFC 9562: the first 48 bits are unix_ts_ms


def test_event_ids_sort_by_the_millisecond_they_were_made_in(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(1_700_000_000_000, 1_700_000_000_500))  # one id a millisecond
    monkeypatch.setattr("roomservice.domain.events.wall_clock_ms", lambda: next(clock))
    ids = [new_event_id() for _ in range(500)]
    assert ids == sorted(ids)  # each a new index entry at the right edge


@pytest.mark.parametrize("raw", [bytes(10), b"\xff" * 10, bytes(range(10)), bytes(range(246, 256))])
@pytest.mark.parametrize("ms", [0, 1_764_806_400_123, 2**48 - 1])
def test_an_event_id_is_the_uuid7_of_its_time_and_random_bytes(
    raw: bytes, ms: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("roomservice.domain.events.os.urandom", lambda n: raw[:n])
    monkeypatch.setattr("roomservice.domain.events.wall_clock_ms", lambda: ms)
    expected = (ms << 80) | int.from_bytes(raw, "big")
    expected = expected & ~(0xF << 76) | 7 << 76  # version 7: the high nibble of byte 6
    expected = expected & ~(0x3 << 62) | 0x2 << 62  # the variant, 0b10: the top two bits of byte 8
    assert new_event_id() == f"{expected:032x}"


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
