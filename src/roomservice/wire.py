"""Event wire codec: domain events <-> the protobuf ``room_outbox_event`` envelope."""

from __future__ import annotations

import re

from roomservice.domain import events as e
from roomservice.domain.fieldnames import field_names
from roomservice.proto import room_outbox_event_pb2 as pb


def _oneof_field(event_type: str) -> str:
    # RoomTreasureOpened -> room_treasure_opened
    return re.sub(r"(?<!^)(?=[A-Z])", "_", event_type).lower()


_FIELD_OF = {t: _oneof_field(t) for t in e.PAYLOAD_TYPES}


def encode_event(event: e.Event) -> bytes:
    envelope = pb.RoomOutboxEvent(
        event_id=event.event_id,
        app_code=event.app_code,
        room_id=event.room_id,
        room_version=event.room_version,
        type=event.type,
        occurred_at_ms=event.occurred_at_ms,
        repair_of=event.repair_of or "",
    )
    getattr(envelope, _FIELD_OF[event.type]).CopyFrom(getattr(pb, event.type)(**event.payload.to_dict()))
    data: bytes = envelope.SerializeToString()
    return data


def decode_event(data: bytes) -> e.Event:
    envelope = pb.RoomOutboxEvent.FromString(data)
    cls = e.PAYLOAD_TYPES[envelope.type]
    message = getattr(envelope, _FIELD_OF[envelope.type])
    values = {}
    for name in field_names(cls):
        value = getattr(message, name)
        values[name] = tuple(value) if name == "recipients" else value
    return e.Event(
        event_id=envelope.event_id,
        app_code=envelope.app_code,
        room_id=envelope.room_id,
        room_version=envelope.room_version,
        occurred_at_ms=envelope.occurred_at_ms,
        payload=cls(**values),
        repair_of=envelope.repair_of or None,
    )
