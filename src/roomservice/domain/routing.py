"""SPEC §3's routing table: which delivery targets each event type has."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class Target(StrEnum):
    IM = "im"  # Tencent IM (direct publisher or IM bridge consumer)
    ACTIVITY = "activity"  # activity service (gRPC or activity consumer)
    NOTICE = "notice"  # C2C private notice, broker only
    TREASURE_WAKEUP = "treasure_wakeup"  # schedule the delayed open
    BROKER = "broker"  # mq/dual mode: one durable publish serves every consumer group (not routed per type)


_ROUTES: dict[str, frozenset[Target]] = {
    "RoomCreated": frozenset({Target.IM, Target.ACTIVITY}),
    "RoomUserJoined": frozenset({Target.IM, Target.ACTIVITY}),
    "RoomUserLeft": frozenset({Target.IM, Target.ACTIVITY}),
    "RoomMicTaken": frozenset({Target.IM}),
    "RoomMicLeft": frozenset({Target.IM}),
    "RoomGiftSent": frozenset({Target.IM, Target.ACTIVITY}),
    "RoomUserKicked": frozenset({Target.IM, Target.ACTIVITY, Target.NOTICE}),
    "RoomTreasureCountdownStarted": frozenset({Target.IM, Target.TREASURE_WAKEUP}),
    "RoomTreasureOpened": frozenset({Target.IM, Target.ACTIVITY}),
    "RoomClosed": frozenset({Target.IM, Target.ACTIVITY}),
}


def targets_of(event_type: str) -> frozenset[Target]:
    return _ROUTES.get(event_type, frozenset())


def for_others_only(tag: str, target: Target) -> bool:
    """Whether a broker message tagged ``tag`` (the broker publisher's tag is the event type) is of a
    type this version knows and does not route to ``target``: a consumer of ``target`` acknowledges it
    without decoding the body. An empty or unknown tag says nothing (a type newer than this version
    may be ours): the body decides."""
    routes = _ROUTES.get(tag)
    return routes is not None and target not in routes


def touches(event_types: Iterable[str], target: Target) -> bool:
    return any(target in targets_of(t) for t in event_types)
