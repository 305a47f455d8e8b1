"""SPEC §3: the protobuf wire form — every event type round-trips through the envelope."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roomservice import wire
from roomservice.domain import commands as c
from roomservice.domain import events as e
from roomservice.proto import room_outbox_event_pb2 as pb
from roomservice.wire import decode_event, encode_event

SAMPLES: list[e.EventPayload] = [
    e.RoomCreated(owner_id="owner", title="Friday 🎤 night", seat_count=20),
    e.RoomUserJoined(user_id="alice", role="member"),
    e.RoomUserJoined(user_id="owner", role="owner"),
    e.RoomUserLeft(user_id="alice"),
    e.RoomMicTaken(user_id="alice", seat=0),  # proto3 default value
    e.RoomMicLeft(user_id="alice", seat=19),
    e.RoomGiftSent(
        sender_id="a", receiver_id="b", gift_id="castle", count=9999, unit_price=5_000_000, total_value=49_995_000_000
    ),
    e.RoomUserKicked(operator_id="owner", target_id="bob", ban_seconds=2_592_000, banned_until_ms=4_102_444_800_000),
    e.RoomClosed(operator_id="owner"),
    e.RoomTreasureCountdownStarted(
        box_id="20240310-1", level=1, open_at_ms=1_710_072_060_000, open_command_id="treasure-open:20240310-1"
    ),
    e.RoomTreasureOpened(box_id="20240310-3", level=3, recipients=tuple(f"u{i}" for i in range(200))),
    e.RoomTreasureOpened(box_id="20240310-2", level=2, recipients=()),
]


def envelope(payload: e.EventPayload, version: int = 7) -> e.Event:
    return e.Event(
        event_id="01J0000000000000000000000",
        app_code="app_1",
        room_id="room-1",
        room_version=version,
        occurred_at_ms=1_710_072_000_123,
        payload=payload,
    )


def test_samples_cover_every_event_type():
    assert {p.type for p in SAMPLES} == set(e.PAYLOAD_TYPES)


@pytest.mark.parametrize("payload", SAMPLES, ids=lambda p: p.type)
def test_every_event_type_round_trips(payload):
    event = envelope(payload)
    assert decode_event(encode_event(event)) == event


@pytest.mark.parametrize("payload", SAMPLES, ids=lambda p: p.type)
def test_a_decoded_event_is_frozen_and_hashes_as_the_one_encoded(payload):
    # the decoder builds events without their __init__ (wire._builder): they must be what __init__ makes
    event = envelope(payload)
    decoded = decode_event(encode_event(event))
    assert type(decoded) is e.Event and type(decoded.payload) is type(payload)
    assert hash(decoded) == hash(event) and repr(decoded) == repr(event)
    for target, name in ((decoded, "room_id"), (decoded.payload, dataclasses.fields(payload)[0].name)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(target, name, "changed")
    assert decoded == event


def test_the_decoders_builder_refuses_a_class_whose_init_does_more_than_set_its_fields():
    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        n: int

        def __post_init__(self) -> None:
            if self.n < 0:
                raise ValueError("n < 0")

    @dataclasses.dataclass(frozen=True, slots=True)
    class Derived:
        n: int
        twice: int = dataclasses.field(init=False, default=0)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Normalised:  # an __init__ written in the class body: dataclass keeps it
        name: str

        def __init__(self, name: str) -> None:
            object.__setattr__(self, "name", name.lower())

    for cls in (Checked, Derived, Normalised):
        with pytest.raises(TypeError, match="does more than set its fields"):
            wire._builder(cls)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Plain:
        a: str
        b: int = 2

    assert wire._builder(Plain)("x", 3) == Plain("x", 3)


@pytest.mark.parametrize("payload", SAMPLES, ids=lambda p: p.type)
def test_the_envelope_carries_the_fields_and_the_matching_oneof(payload):
    msg = pb.RoomOutboxEvent.FromString(encode_event(envelope(payload, version=42)))
    assert (msg.event_id, msg.app_code, msg.room_id, msg.room_version, msg.type, msg.occurred_at_ms) == (
        "01J0000000000000000000000",
        "app_1",
        "room-1",
        42,
        payload.type,
        1_710_072_000_123,
    )
    assert msg.WhichOneof("payload") is not None
    assert type(getattr(msg, msg.WhichOneof("payload"))).__name__ == payload.type


def test_decoded_recipients_are_a_tuple():
    decoded = decode_event(encode_event(envelope(SAMPLES[-2])))
    assert isinstance(decoded.payload.recipients, tuple)


def test_events_of_a_real_session_round_trip(open_room):
    open_room.join("carol")
    open_room.send(c.TakeMic(user_id="alice", seat=0))
    open_room.send(c.TakeMic(user_id="alice", seat=3))
    open_room.gift("alice", "bob", "castle", count=10)
    open_room.open_box()
    open_room.send(c.KickUser(operator_id="owner", target_id="alice"))
    open_room.send(c.LeaveRoom(user_id="bob"))
    open_room.send(c.CloseRoom(operator_id="owner"))
    assert {ev.type for ev in open_room.log} == set(e.PAYLOAD_TYPES)
    for ev in open_room.log:
        assert decode_event(encode_event(ev)) == ev


def test_event_dict_form_round_trips():
    for payload in SAMPLES:
        event = envelope(payload)
        assert e.Event.from_dict(event.to_dict()) == event


ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-", min_size=1, max_size=64)
int32s = st.integers(min_value=0, max_value=2**31 - 1)
int64s = st.integers(min_value=0, max_value=2**63 - 1)
payloads = st.one_of(
    st.builds(e.RoomCreated, owner_id=ids, title=st.text(min_size=1, max_size=64), seat_count=int32s),
    st.builds(e.RoomUserJoined, user_id=ids, role=st.sampled_from(["owner", "member"])),
    st.builds(e.RoomUserLeft, user_id=ids),
    st.builds(e.RoomMicTaken, user_id=ids, seat=int32s),
    st.builds(e.RoomMicLeft, user_id=ids, seat=int32s),
    st.builds(
        e.RoomGiftSent,
        sender_id=ids,
        receiver_id=ids,
        gift_id=ids,
        count=int32s,
        unit_price=int64s,
        total_value=int64s,
    ),
    st.builds(e.RoomUserKicked, operator_id=ids, target_id=ids, ban_seconds=int64s, banned_until_ms=int64s),
    st.builds(e.RoomClosed, operator_id=ids),
    st.builds(e.RoomTreasureCountdownStarted, box_id=ids, level=int32s, open_at_ms=int64s, open_command_id=ids),
    st.builds(e.RoomTreasureOpened, box_id=ids, level=int32s, recipients=st.lists(ids, max_size=20).map(tuple)),
)


@settings(max_examples=100, deadline=None)
@given(payload=payloads, version=int64s, at=int64s, event_id=ids)
def test_any_event_round_trips(payload, version, at, event_id):
    event = e.Event(
        event_id=event_id, app_code="app_1", room_id="room-1", room_version=version, occurred_at_ms=at, payload=payload
    )
    assert decode_event(encode_event(event)) == event
