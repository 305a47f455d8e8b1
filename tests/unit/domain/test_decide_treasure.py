"""SPEC §3: the treasure box — cumulative levels, one countdown at a time, wake-ups, UTC reset.

Rules under test: levels (1000, 5000, 20000), countdown 60 s; gift prices
rose 10, heart 100, rocket 1000, castle 5000.
"""

from __future__ import annotations

import pytest

from roomservice import errors
from roomservice.domain import commands as c
from roomservice.domain import events as e
from roomservice.domain.decider import replay
from roomservice.domain.limits import MAX_TREASURE_RECIPIENTS
from roomservice.domain.rules import Gift, RoomRules
from roomservice.domain.state import PendingBox, RoomState
from roomservice.domain.view import room_view

COUNTDOWN_MS = 60_000


def started(day: str, level: int, open_at_ms: int) -> e.RoomTreasureCountdownStarted:
    box_id = f"{day}-{level}"
    return e.RoomTreasureCountdownStarted(
        box_id=box_id, level=level, open_at_ms=open_at_ms, open_command_id=f"treasure-open:{box_id}"
    )


def wake(box: PendingBox) -> c.OpenTreasure:
    return c.OpenTreasure(box_id=box.box_id, level=box.level, open_at_ms=box.open_at_ms)


def box_of(state: RoomState) -> PendingBox:
    assert state.treasure.box is not None
    return state.treasure.box


# ----------------------------------------------------------------------------- energy and thresholds


def test_energy_below_the_first_threshold_starts_nothing(open_room):
    assert [p.type for p in open_room.gift("alice", "bob", "heart", count=9)] == ["RoomGiftSent"]
    t = open_room.live.treasure
    assert (t.energy, t.opened, t.box) == (900, 0, None)


def test_reaching_the_first_threshold_starts_level_one(open_room):
    open_room.gift("alice", "bob", "heart", count=9)
    payloads = open_room.gift("bob", "alice", "rose", count=10)  # cumulative 1000
    assert payloads[1:] == [started(open_room.DAY1, 1, open_room.now_ms + COUNTDOWN_MS)]
    assert box_of(open_room.live) == PendingBox(f"{open_room.DAY1}-1", 1, open_room.now_ms + COUNTDOWN_MS)
    assert open_room.live.treasure.energy == 1000


def test_countdown_started_is_its_own_event_after_the_gift_in_the_same_version(open_room):
    events = open_room.send(c.SendGift(sender_id="alice", receiver_id="bob", gift_id="rocket", count=1))
    assert [ev.type for ev in events] == ["RoomGiftSent", "RoomTreasureCountdownStarted"]
    assert {ev.room_version for ev in events} == {open_room.live.version}


def test_countdown_length_comes_from_the_rules(make_room):
    r = make_room(rules=RoomRules(gifts={"g": Gift("g", "G", 10)}, treasure_levels=(10,), treasure_countdown_ms=5))
    r.create()
    [_, start] = r.gift("owner", "owner", "g")
    assert start.open_at_ms == r.now_ms + 5


def test_energy_keeps_accumulating_during_a_countdown_and_only_one_box_counts_down(open_room):
    open_room.gift("alice", "bob", "rocket")
    box = box_of(open_room.live)
    # Far past level 2 and 3 while level 1 counts down: nothing new starts.
    assert [p.type for p in open_room.gift("alice", "bob", "castle", count=5)] == ["RoomGiftSent"]
    assert [p.type for p in open_room.gift("bob", "alice", "rose")] == ["RoomGiftSent"]
    t = open_room.live.treasure
    assert (t.energy, t.opened, t.box) == (26_010, 0, box)


def test_opening_chains_the_next_countdown_when_energy_already_reaches_it(open_room):
    open_room.gift("alice", "bob", "rocket")
    open_room.gift("alice", "bob", "castle")  # energy 6000 >= 5000 during level 1's countdown
    first = box_of(open_room.live)
    payloads = open_room.open_box()
    assert open_room.now_ms == first.open_at_ms
    assert payloads == [
        e.RoomTreasureOpened(box_id=f"{open_room.DAY1}-1", level=1, recipients=("owner", "alice", "bob")),
        started(open_room.DAY1, 2, first.open_at_ms + COUNTDOWN_MS),
    ]
    t = open_room.live.treasure
    assert (t.opened, t.energy) == (1, 6000)
    assert box_of(open_room.live).level == 2


def test_opening_without_enough_energy_for_the_next_level_starts_nothing(open_room):
    open_room.gift("alice", "bob", "rocket")
    v = open_room.version
    payloads = open_room.open_box()
    assert [p.type for p in payloads] == ["RoomTreasureOpened"]
    assert open_room.version == v + 1
    t = open_room.live.treasure
    assert (t.opened, t.box) == (1, None)
    # Later the next threshold (cumulative 5000) is reached by a gift.
    open_room.advance(1000)
    assert [p.type for p in open_room.gift("alice", "bob", "heart", count=39)] == ["RoomGiftSent"]
    assert open_room.gift("alice", "bob", "heart")[1:] == [started(open_room.DAY1, 2, open_room.now_ms + COUNTDOWN_MS)]


def test_one_huge_gift_walks_the_levels_one_countdown_at_a_time_and_stops_after_the_last(open_room):
    payloads = open_room.gift("alice", "bob", "castle", count=10)  # 50 000 crosses every threshold
    assert [p.type for p in payloads] == ["RoomGiftSent", "RoomTreasureCountdownStarted"]
    assert payloads[1].level == 1
    assert [p.type for p in open_room.open_box()] == ["RoomTreasureOpened", "RoomTreasureCountdownStarted"]
    assert [p.type for p in open_room.open_box()] == ["RoomTreasureOpened", "RoomTreasureCountdownStarted"]
    last = open_room.open_box()
    assert [(p.type, p.level) for p in last] == [("RoomTreasureOpened", 3)]
    t = open_room.live.treasure
    assert (t.opened, t.box) == (3, None)
    # After the last level nothing more starts that day.
    assert [p.type for p in open_room.gift("alice", "bob", "castle", count=100)] == ["RoomGiftSent"]
    assert open_room.live.treasure.box is None
    assert open_room.live.treasure.opened == 3


def test_box_ids_are_unique_and_name_the_day_and_level(open_room):
    open_room.gift("alice", "bob", "castle", count=10)
    ids = [box_of(open_room.live).box_id]
    open_room.open_box()
    ids.append(box_of(open_room.live).box_id)
    open_room.open_box()
    ids.append(box_of(open_room.live).box_id)
    open_room.open_box()
    open_room.at(open_room.MIDNIGHT_MS + 1)
    open_room.gift("alice", "bob", "rocket")
    ids.append(box_of(open_room.live).box_id)
    assert ids == [f"{open_room.DAY1}-1", f"{open_room.DAY1}-2", f"{open_room.DAY1}-3", f"{open_room.DAY2}-1"]
    starts = [ev.payload for ev in open_room.log if isinstance(ev.payload, e.RoomTreasureCountdownStarted)]
    assert [s.open_command_id for s in starts] == [f"treasure-open:{i}" for i in ids]
    assert all(s.open_command_id == c.treasure_open_command_id(s.box_id) for s in starts)


# ----------------------------------------------------------------------------- wake-ups


def test_wake_up_before_open_at_is_too_early_and_carries_open_at(open_room):
    open_room.gift("alice", "bob", "rocket")
    box = box_of(open_room.live)
    before = open_room.live
    open_room.at(box.open_at_ms - 1)
    with pytest.raises(errors.TreasureTooEarly) as info:
        open_room.send(wake(box))
    assert info.value.open_at_ms == box.open_at_ms
    assert info.value.code == "too_early"
    assert isinstance(info.value, errors.DomainError)
    assert open_room.live == before


def test_wake_up_exactly_at_open_at_opens(open_room):
    open_room.gift("alice", "bob", "rocket")
    box = box_of(open_room.live)
    open_room.at(box.open_at_ms)
    assert [p.type for p in open_room.payloads(wake(box))] == ["RoomTreasureOpened"]


def test_late_wake_up_still_opens_the_same_day(open_room):
    open_room.gift("alice", "bob", "rocket")
    box = box_of(open_room.live)
    open_room.at(box.open_at_ms + 3_600_000)
    [opened] = open_room.payloads(wake(box))
    assert (opened.box_id, opened.level) == (box.box_id, box.level)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: c.OpenTreasure(box_id="20240310-9", level=b.level, open_at_ms=b.open_at_ms),
        lambda b: c.OpenTreasure(box_id=b.box_id, level=2, open_at_ms=b.open_at_ms),
        lambda b: c.OpenTreasure(box_id=b.box_id, level=b.level, open_at_ms=b.open_at_ms - 1),
        lambda b: c.OpenTreasure(box_id=b.box_id, level=b.level, open_at_ms=b.open_at_ms + 1),
        lambda b: c.OpenTreasure(box_id="20240309-1", level=1, open_at_ms=b.open_at_ms),
    ],
    ids=["box_id", "level", "open_at_earlier", "open_at_later", "yesterday"],
)
def test_stale_wake_up_is_a_no_op(open_room, mutate):
    open_room.gift("alice", "bob", "rocket")
    box = box_of(open_room.live)
    open_room.at(box.open_at_ms + 10)
    before = open_room.live
    assert open_room.send(mutate(box)) == []
    assert open_room.live == before


def test_stale_wake_up_before_open_at_is_a_no_op_not_too_early(open_room):
    open_room.gift("alice", "bob", "rocket")
    box = box_of(open_room.live)
    assert open_room.send(c.OpenTreasure(box_id=box.box_id, level=1, open_at_ms=box.open_at_ms + 5)) == []


def test_wake_up_without_any_box_is_a_no_op(open_room):
    before = open_room.live
    assert open_room.send(c.OpenTreasure(box_id=f"{open_room.DAY1}-1", level=1, open_at_ms=open_room.now_ms)) == []
    assert open_room.live == before


def test_duplicate_wake_up_is_a_no_op(open_room):
    open_room.gift("alice", "bob", "rocket")
    box = box_of(open_room.live)
    open_room.at(box.open_at_ms)
    open_room.send(wake(box))
    v = open_room.version
    open_room.advance(5000)
    assert open_room.send(wake(box)) == []
    assert open_room.version == v


def test_duplicate_wake_up_while_the_next_box_counts_down_is_a_no_op(open_room):
    open_room.gift("alice", "bob", "castle", count=2)
    first = box_of(open_room.live)
    open_room.open_box()
    second = box_of(open_room.live)
    assert second.level == 2
    assert open_room.send(wake(first)) == []
    assert box_of(open_room.live) == second


def test_wake_up_in_a_closed_room_is_a_no_op_and_the_box_never_opens(open_room):
    open_room.gift("alice", "bob", "rocket")
    box = box_of(open_room.live)
    open_room.send(c.CloseRoom(operator_id="owner"))
    before = open_room.live
    for at in (box.open_at_ms - 1, box.open_at_ms, box.open_at_ms + 60_000):
        open_room.at(at)
        assert open_room.send(wake(box)) == []
    assert open_room.live == before
    assert not any(ev.type == "RoomTreasureOpened" for ev in open_room.log)


def test_closing_drops_the_pending_box_from_state_and_view(open_room):
    open_room.gift("alice", "bob", "rocket")
    assert open_room.live.treasure.box is not None
    open_room.send(c.CloseRoom(operator_id="owner"))
    assert open_room.live.treasure.box is None
    view = room_view(open_room.live, now_ms=open_room.now_ms, level_count=len(open_room.rules.treasure_levels))
    assert view["treasure"]["state"] == "idle"
    assert view["treasure"]["box_id"] is None
    assert view["treasure"]["energy"] == open_room.live.treasure.energy > 0


def test_wake_up_for_a_missing_room_is_room_not_found(room):
    with pytest.raises(errors.RoomNotFound):
        room.send(c.OpenTreasure(box_id="x-1", level=1, open_at_ms=0))


# ----------------------------------------------------------------------------- recipients


def test_recipients_are_the_members_present_in_join_order(open_room):
    open_room.join("carol")
    open_room.send(c.LeaveRoom(user_id="alice"))
    open_room.send(c.KickUser(operator_id="owner", target_id="bob"))
    open_room.join("alice", "dave")
    open_room.gift("carol", "owner", "rocket")
    [opened] = open_room.open_box()
    assert opened.recipients == ("owner", "carol", "alice", "dave")


def test_recipients_are_read_at_opening_not_at_countdown_start(open_room):
    open_room.gift("alice", "bob", "rocket")
    open_room.send(c.LeaveRoom(user_id="bob"))
    open_room.join("carol")
    [opened] = open_room.open_box()
    assert opened.recipients == ("owner", "alice", "carol")


def test_recipients_are_capped_at_200_first_joined_first(open_room):
    users = [f"u{i:03d}" for i in range(250)]
    open_room.join(*users)
    open_room.gift("alice", "bob", "rocket")
    [opened] = open_room.open_box()
    assert MAX_TREASURE_RECIPIENTS == 200
    assert len(opened.recipients) == 200
    assert opened.recipients == ("owner", "alice", "bob", *users[:197])


def test_recipients_may_be_empty(open_room):
    open_room.gift("alice", "bob", "rocket")
    for user in ("owner", "alice", "bob"):
        open_room.send(c.LeaveRoom(user_id=user))
    [opened] = open_room.open_box()
    assert opened.recipients == ()


# ----------------------------------------------------------------------------- UTC day reset


def test_energy_level_and_box_reset_at_utc_midnight(open_room):
    open_room.gift("alice", "bob", "castle")  # 5000: level 1 box
    open_room.open_box()  # opens level 1, chains level 2
    assert open_room.live.treasure.opened == 1
    pending = box_of(open_room.live)
    open_room.at(open_room.MIDNIGHT_MS)
    payloads = open_room.gift("alice", "bob", "heart")
    assert [p.type for p in payloads] == ["RoomGiftSent"]
    t = open_room.live.treasure
    assert (t.energy, t.opened, t.box) == (100, 0, None)
    # Yesterday's pending box is stale now, even though its open_at has passed.
    open_room.at(pending.open_at_ms + open_room.MIDNIGHT_MS)
    assert open_room.send(wake(pending)) == []


def test_last_millisecond_of_the_day_still_counts_for_that_day(open_room):
    open_room.gift("alice", "bob", "heart", count=9)
    open_room.at(open_room.MIDNIGHT_MS - 1)
    assert open_room.gift("alice", "bob", "heart")[1:] == [
        started(open_room.DAY1, 1, open_room.MIDNIGHT_MS - 1 + COUNTDOWN_MS)
    ]


def test_a_box_started_before_midnight_is_stale_after_it(open_room):
    open_room.at(open_room.MIDNIGHT_MS - 30_000)
    open_room.gift("alice", "bob", "rocket")
    box = box_of(open_room.live)
    assert box.open_at_ms == open_room.MIDNIGHT_MS + 30_000
    # Still yesterday: too early.
    open_room.at(open_room.MIDNIGHT_MS - 1)
    with pytest.raises(errors.TreasureTooEarly):
        open_room.send(wake(box))
    # At open_at (already the next UTC day) the box is gone.
    open_room.at(box.open_at_ms)
    v = open_room.version
    assert open_room.send(wake(box)) == []
    assert open_room.version == v


def test_first_box_of_the_new_day_starts_from_level_one_with_a_new_id(open_room):
    open_room.gift("alice", "bob", "castle", count=10)
    for _ in range(3):
        open_room.open_box()
    assert open_room.live.treasure.opened == 3
    open_room.at(open_room.MIDNIGHT_MS + 3_600_000)
    assert open_room.gift("alice", "bob", "rocket")[1:] == [started(open_room.DAY2, 1, open_room.now_ms + COUNTDOWN_MS)]


def test_gift_during_yesterdays_countdown_after_midnight_starts_todays_box(open_room):
    open_room.at(open_room.MIDNIGHT_MS - 10_000)
    open_room.gift("alice", "bob", "rocket")
    old = box_of(open_room.live)
    open_room.at(open_room.MIDNIGHT_MS + 10_000)
    assert open_room.gift("alice", "bob", "rocket")[1:] == [started(open_room.DAY2, 1, open_room.now_ms + COUNTDOWN_MS)]
    new = box_of(open_room.live)
    open_room.at(old.open_at_ms)
    assert open_room.send(wake(old)) == []
    assert box_of(open_room.live) == new
    assert [p.type for p in open_room.open_box()] == ["RoomTreasureOpened"]


def test_replay_across_midnight_is_deterministic(open_room):
    open_room.gift("alice", "bob", "castle")
    open_room.at(open_room.MIDNIGHT_MS - 100)
    open_room.gift("alice", "bob", "heart", count=3)
    open_room.at(open_room.MIDNIGHT_MS + 100)
    open_room.gift("alice", "bob", "rocket")
    open_room.open_box()
    open_room.at(open_room.MIDNIGHT_MS + 86_400_000 + 5)
    open_room.send(c.TakeMic(user_id="alice", seat=0))  # a non-treasure event on day 3
    rebuilt = replay(None, open_room.log)
    assert rebuilt.to_dict() == open_room.live.to_dict()
    # Replaying a prefix gives the state as it was then, regardless of "now".
    assert replay(None, open_room.log[:5]).treasure.energy == 5000  # create, 2 joins, gift + countdown


def test_the_view_shows_the_reset_before_any_event_of_the_new_day(open_room):
    open_room.gift("alice", "bob", "castle")
    open_room.open_box()
    levels = len(open_room.rules.treasure_levels)
    before = room_view(open_room.live, now_ms=open_room.now_ms, level_count=levels)["treasure"]
    assert before == {
        "energy": 5000,
        "level": 1,
        "box_id": f"{open_room.DAY1}-2",
        "state": "counting_down",
        "open_at_ms": box_of(open_room.live).open_at_ms,
    }
    after = room_view(open_room.live, now_ms=open_room.MIDNIGHT_MS, level_count=levels)["treasure"]
    assert after == {"energy": 0, "level": 0, "box_id": None, "state": "idle", "open_at_ms": None}
