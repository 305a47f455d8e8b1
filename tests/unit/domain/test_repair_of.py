"""The envelope's ``repair_of`` (issue 7, item 1.4): a repair names its original; dedup keys follow it."""

from __future__ import annotations

from dataclasses import replace

from roomservice.domain import events as e
from roomservice.proto import room_outbox_event_pb2 as pb
from roomservice.wire import decode_event, encode_event

ORIGINAL = e.Event(
    event_id="original-1",
    app_code="app_1",
    room_id="room-1",
    room_version=3,
    occurred_at_ms=1_710_072_000_123,
    payload=e.RoomGiftSent(sender_id="a", receiver_id="b", gift_id="rose", count=3, unit_price=10, total_value=30),
)
REPAIR = replace(ORIGINAL, event_id="repair-1", repair_of="original-1")


def test_a_repair_round_trips_and_names_its_original_on_the_wire() -> None:
    data = encode_event(REPAIR)
    assert decode_event(data) == REPAIR
    msg = pb.RoomOutboxEvent.FromString(data)
    assert (msg.event_id, msg.repair_of) == ("repair-1", "original-1")


def test_an_ordinary_event_has_no_repair_of_and_the_same_bytes_as_before() -> None:
    data = encode_event(ORIGINAL)
    assert decode_event(data).repair_of is None
    # proto3 leaves an empty string off the wire: old and new encoders agree byte for byte
    legacy = pb.RoomOutboxEvent(
        event_id="original-1",
        app_code="app_1",
        room_id="room-1",
        room_version=3,
        type="RoomGiftSent",
        occurred_at_ms=1_710_072_000_123,
        room_gift_sent=pb.RoomGiftSent(
            sender_id="a", receiver_id="b", gift_id="rose", count=3, unit_price=10, total_value=30
        ),
    ).SerializeToString()
    assert data == legacy


def test_dedup_id_is_the_original_for_a_repair() -> None:
    assert e.dedup_id(ORIGINAL) == "original-1"
    assert e.dedup_id(REPAIR) == "original-1"


def test_the_command_log_form_keeps_repair_of_only_when_set() -> None:
    assert "repair_of" not in ORIGINAL.to_dict()
    assert REPAIR.to_dict()["repair_of"] == "original-1"
    assert e.Event.from_dict(REPAIR.to_dict()) == REPAIR
    assert e.Event.from_dict(ORIGINAL.to_dict()) == ORIGINAL
