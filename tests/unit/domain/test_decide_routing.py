"""SPEC §3 routing table: which delivery targets each event type has."""

from __future__ import annotations

import pytest

from roomservice.domain import events as e
from roomservice.domain.routing import Target, targets_of, touches

IM, ACT, NOTICE, WAKE = Target.IM, Target.ACTIVITY, Target.NOTICE, Target.TREASURE_WAKEUP

# Transcribed from SPEC §3 "Routing": Tencent IM | activity | notice (+ the treasure wake-up).
SPEC_ROUTES = {
    "RoomCreated": {IM, ACT},
    "RoomUserJoined": {IM, ACT},
    "RoomUserLeft": {IM, ACT},
    "RoomMicTaken": {IM},
    "RoomMicLeft": {IM},
    "RoomGiftSent": {IM, ACT},
    "RoomUserKicked": {IM, ACT, NOTICE},
    "RoomTreasureCountdownStarted": {IM, WAKE},
    "RoomTreasureOpened": {IM, ACT},
    "RoomClosed": {IM, ACT},
}


def test_the_table_covers_exactly_the_event_types():
    assert set(SPEC_ROUTES) == set(e.PAYLOAD_TYPES)


@pytest.mark.parametrize(("event_type", "targets"), sorted(SPEC_ROUTES.items()))
def test_routes_match_the_spec(event_type, targets):
    assert targets_of(event_type) == frozenset(targets)


def test_every_event_reaches_tencent_im():
    assert all(IM in targets_of(t) for t in e.PAYLOAD_TYPES)


def test_only_kicks_send_a_private_notice():
    assert [t for t in e.PAYLOAD_TYPES if NOTICE in targets_of(t)] == ["RoomUserKicked"]


def test_only_countdowns_schedule_a_wake_up():
    assert [t for t in e.PAYLOAD_TYPES if WAKE in targets_of(t)] == ["RoomTreasureCountdownStarted"]


def test_mic_events_and_countdowns_skip_the_activity_service():
    no_activity = {t for t in e.PAYLOAD_TYPES if ACT not in targets_of(t)}
    assert no_activity == {"RoomMicTaken", "RoomMicLeft", "RoomTreasureCountdownStarted"}


def test_unknown_event_type_has_no_targets():
    assert targets_of("RoomDanced") == frozenset()


def test_touches():
    assert touches(["RoomMicTaken", "RoomUserKicked"], NOTICE)
    assert not touches(["RoomMicTaken", "RoomMicLeft"], ACT)
    assert touches(["RoomMicLeft", "RoomUserLeft"], ACT)
    assert not touches([], IM)
    assert touches(["RoomGiftSent", "RoomTreasureCountdownStarted"], WAKE)


def test_target_values_are_stable_strings():
    assert {t.value for t in Target} == {"im", "activity", "notice", "treasure_wakeup", "broker"}
