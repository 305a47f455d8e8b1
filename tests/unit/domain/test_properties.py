"""Property tests: random command sequences keep the room's invariants (SPEC §3).

Each example creates a room and applies a random sequence of commands the way
the Room Cell does — ``decide`` on the live state (a DomainError leaves it
untouched), ``stamp`` the payloads with the next version, ``evolve`` over the
events — while a clock moves forward at random, often across 00:00 UTC.
After every step the invariants below are checked, including that replaying
the whole log rebuilds the live state.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from roomservice import errors
from roomservice.domain import commands as c
from roomservice.domain import events as e
from roomservice.domain.decider import decide, evolve, replay, stamp
from roomservice.domain.limits import MAX_TREASURE_RECIPIENTS
from roomservice.domain.rules import Gift, RoomRules
from roomservice.domain.state import CLOSED, RoomState, day_label, utc_day
from roomservice.domain.view import room_view

APP, ROOM = "app_1", "room-1"
USERS = ["u0", "u1", "u2", "u3", "u4", "u5"]
OWNER = USERS[0]
RULES = RoomRules(
    gifts={
        "rose": Gift("rose", "Rose", 10),
        "heart": Gift("heart", "Heart", 300),
        "rocket": Gift("rocket", "Rocket", 1000),
        "castle": Gift("castle", "Castle", 5000),
    },
    default_seat_count=4,
    default_ban_seconds=600,
    treasure_levels=(1000, 5000, 20000),
    treasure_countdown_ms=60_000,
)
LEVELS = RULES.treasure_levels
MIDNIGHT_MS = int(datetime(2024, 3, 11, tzinfo=UTC).timestamp() * 1000)
HOUR_MS = 3_600_000

users = st.sampled_from(USERS)
# Steps of the clock: often none or small, sometimes past a countdown, a ban or a whole day.
clock_steps = st.one_of(
    st.sampled_from([0, 0, 1, 999, 60_000, 600_000, HOUR_MS, 86_400_000]),
    st.integers(min_value=0, max_value=2 * HOUR_MS),
)

operators = st.one_of(st.just(OWNER), users)  # the owner half of the time, so kicks succeed too
actions = {
    "join": st.tuples(st.just("join"), users),
    "leave": st.tuples(st.just("leave"), users),
    "take": st.tuples(st.just("take"), users, st.sampled_from([-1, 0, 0, 0, 1, 1, 2, 3, 4])),
    "leave_mic": st.tuples(st.just("leave_mic"), users),
    "gift": st.tuples(
        st.just("gift"),
        users,
        users,
        st.sampled_from(["rose", "heart", "rocket", "castle", "castle", "unicorn"]),
        st.integers(min_value=1, max_value=8),
    ),
    "kick": st.tuples(st.just("kick"), operators, users, st.sampled_from([None, 1, 30, 900])),
    "wake_pending": st.tuples(st.just("wake_pending"), st.sampled_from([-30_000, -1, 0, 0, 1, 90_000])),
    "wake_random": st.tuples(
        st.just("wake_random"),
        st.sampled_from(["20240310", "20240311", "20240312"]),
        st.integers(min_value=0, max_value=4),
        st.integers(min_value=MIDNIGHT_MS - HOUR_MS, max_value=MIDNIGHT_MS + 3 * HOUR_MS),
    ),
    "create": st.tuples(st.just("create"), users),
    # Rare on purpose: a closed room turns every later client command into room_closed.
    "close": st.tuples(st.just("close"), operators),
}
# Relative weights of the action kinds (a kind listed n times is drawn n times as often).
KINDS = [
    *["join"] * 6,
    *["leave"] * 2,
    *["take"] * 4,
    *["leave_mic"] * 2,
    *["gift"] * 8,
    *["kick"] * 3,
    *["wake_pending"] * 5,
    *["wake_random"] * 2,
    "create",
]


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    steps = []
    for _ in range(draw(st.integers(min_value=0, max_value=40))):
        # About one step in 80 is a CloseRoom attempt.
        close = draw(st.integers(min_value=0, max_value=79)) == 0
        kind = "close" if close else draw(st.sampled_from(KINDS))
        steps.append((draw(clock_steps), draw(actions[kind])))
    return {
        "start_ms": draw(st.integers(min_value=MIDNIGHT_MS - 3 * HOUR_MS, max_value=MIDNIGHT_MS + HOUR_MS)),
        "seat_count": draw(st.sampled_from([None, 1, 2, 3])),
        # Members who join right after creation, so member-only commands mostly get past not_member.
        "joiners": draw(st.lists(st.sampled_from(USERS[1:]), min_size=2, max_size=5, unique=True)),
        "steps": steps,
    }


def to_command(action: tuple[Any, ...], state: RoomState, now_ms: int) -> tuple[c.Command, int]:
    """The command for ``action`` and the time it is decided at (wake-ups may move the clock)."""
    kind, *args = action
    if kind == "join":
        return c.JoinRoom(user_id=args[0]), now_ms
    if kind == "leave":
        return c.LeaveRoom(user_id=args[0]), now_ms
    if kind == "take":
        return c.TakeMic(user_id=args[0], seat=args[1]), now_ms
    if kind == "leave_mic":
        return c.LeaveMic(user_id=args[0]), now_ms
    if kind == "gift":
        return c.SendGift(sender_id=args[0], receiver_id=args[1], gift_id=args[2], count=args[3]), now_ms
    if kind == "kick":
        return c.KickUser(operator_id=args[0], target_id=args[1], ban_seconds=args[2]), now_ms
    if kind == "close":
        return c.CloseRoom(operator_id=args[0]), now_ms
    if kind == "create":
        return c.CreateRoom(owner_id=args[0], title="again"), now_ms
    if kind == "wake_pending":
        box = state.treasure.box
        if box is None:  # nothing pending: a plausible wake-up for today's first box
            return c.OpenTreasure(box_id=f"{day_label(utc_day(now_ms))}-1", level=1, open_at_ms=now_ms), now_ms
        return (
            c.OpenTreasure(box_id=box.box_id, level=box.level, open_at_ms=box.open_at_ms),
            max(now_ms, box.open_at_ms + args[0]),
        )
    if kind == "wake_random":
        day, level, open_at = args
        return c.OpenTreasure(box_id=f"{day}-{level}", level=level, open_at_ms=open_at), now_ms
    raise AssertionError(kind)


def expected_wake(state: RoomState, cmd: c.OpenTreasure, now_ms: int) -> str:
    """What SPEC §3 says a wake-up does: "noop", "too_early" or "open"."""
    if state.status == CLOSED:
        return "noop"
    t = state.treasure.on_day(utc_day(now_ms))
    box = t.box
    if box is None or (box.box_id, box.level, box.open_at_ms) != (cmd.box_id, cmd.level, cmd.open_at_ms):
        return "noop"
    return "too_early" if now_ms < box.open_at_ms else "open"


def check_invariants(state: RoomState, log: list[e.Event], now_ms: int) -> None:
    # The view lists what the state holds (its entries are reused from the room's last view).
    shown = room_view(state, now_ms=now_ms, level_count=len(LEVELS))
    assert shown["members"] == [
        {"user_id": u, "role": "owner" if u == state.owner_id else "member", "joined_at_ms": at}
        for u, at in state.members.items()
    ]
    assert shown["seats"] == [{"index": i, "user_id": holder} for i, holder in enumerate(state.seats)]
    # Seats: a user holds at most one seat, and only members hold seats.
    holders = [h for h in state.seats if h is not None]
    assert len(holders) == len(set(holders)), state.seats
    assert all(state.is_member(h) for h in holders), (state.seats, state.members)
    assert len(state.seats) == state.seat_count
    # Actively banned users are not members.
    for user, until in state.bans.items():
        if until > now_ms:
            assert not state.is_member(user), (user, until, now_ms)
    # The owner never changes and keeps the owner role.
    assert state.owner_id == OWNER
    assert state.role_of(OWNER) == "owner"
    # Replay of the whole log rebuilds the live state; the dict form round-trips.
    rebuilt = replay(None, log)
    assert rebuilt is not None
    assert rebuilt.to_dict() == state.to_dict()
    assert RoomState.from_dict(state.to_dict()) == state
    assert RoomState.from_dict(state.to_dict()).to_dict() == state.to_dict()
    # Versions: consecutive per state-changing command, starting at 1.
    versions = sorted({ev.room_version for ev in log})
    assert versions == list(range(1, state.version + 1))
    # Treasure: at most the configured levels; one box at a time, for the next level.
    t = state.treasure
    assert 0 <= t.opened <= len(LEVELS)
    if t.box is not None:
        assert t.box.level == t.opened + 1
        assert t.box.box_id == f"{day_label(t.day)}-{t.box.level}"
        assert t.energy >= LEVELS[t.box.level - 1]
    elif t.opened < len(LEVELS) and state.status == "open":
        assert t.energy < LEVELS[t.opened], "a reached threshold must have started a countdown"
    if state.status == "closed":
        assert t.box is None, "a closed room keeps no box counting down"
    # The day's energy and levels are exactly what that UTC day's events say.
    today = [ev for ev in log if utc_day(ev.occurred_at_ms) == t.day]
    assert t.energy == sum(ev.payload.total_value for ev in today if isinstance(ev.payload, e.RoomGiftSent))
    opened = [ev.payload.level for ev in today if isinstance(ev.payload, e.RoomTreasureOpened)]
    assert t.opened == max(opened, default=0)
    started = {ev.payload.box_id for ev in today if isinstance(ev.payload, e.RoomTreasureCountdownStarted)}
    done = {ev.payload.box_id for ev in today if isinstance(ev.payload, e.RoomTreasureOpened)}
    assert done <= started
    pending = started - done
    assert len(pending) <= 1
    if state.status == "open":  # closing drops the pending box
        assert pending == ({t.box.box_id} if t.box is not None else set())
    # Box ids are never reused.
    all_started = [ev.payload.box_id for ev in log if isinstance(ev.payload, e.RoomTreasureCountdownStarted)]
    assert len(all_started) == len(set(all_started))
    assert state.heat == sum(ev.payload.total_value for ev in log if isinstance(ev.payload, e.RoomGiftSent))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_random_command_sequences_keep_the_invariants(scenario: dict[str, Any]) -> None:
    now_ms: int = scenario["start_ms"]
    event_ids = iter(range(1, 10**9))

    def apply(state: RoomState | None, cmd: c.Command, at: int) -> tuple[RoomState | None, list[e.Event]]:
        payloads = decide(state, cmd, now_ms=at, rules=RULES)
        events = stamp(
            payloads, state=state, app_code=APP, room_id=ROOM, now_ms=at, new_event_id=lambda: f"ev-{next(event_ids)}"
        )
        for ev in events:
            state = evolve(state, ev)
        return state, events

    state, log = apply(None, c.CreateRoom(owner_id=OWNER, title="t", seat_count=scenario["seat_count"]), now_ms)
    assert state is not None
    assert state.version == 1
    check_invariants(state, log, now_ms)
    for user in scenario["joiners"]:
        state, events = apply(state, c.JoinRoom(user_id=user), now_ms)
        log.extend(events)
    check_invariants(state, log, now_ms)

    for step_ms, action in scenario["steps"]:
        now_ms += step_ms
        cmd, now_ms = to_command(action, state, now_ms)
        before = state
        before_dict = state.to_dict()
        wake = expected_wake(state, cmd, now_ms) if isinstance(cmd, c.OpenTreasure) else None
        error: errors.DomainError | None = None
        try:
            state, events = apply(state, cmd, now_ms)
        except errors.DomainError as exc:
            error = exc
            state, events = before, []
        assert before.to_dict() == before_dict, "decide mutated the state"
        if error is not None:
            if isinstance(cmd, c.OpenTreasure):
                # A wake-up only ever fails as "too early", for the pending box itself.
                assert isinstance(error, errors.TreasureTooEarly), error
                assert wake == "too_early"
                assert error.open_at_ms == cmd.open_at_ms
            elif isinstance(cmd, c.CreateRoom):
                assert isinstance(error, errors.RoomExists)
            elif before.status == CLOSED:
                assert isinstance(error, errors.RoomClosed)
        else:
            assert not isinstance(cmd, c.CreateRoom), "a second CreateRoom must fail"
            assert before.status != CLOSED or isinstance(cmd, c.OpenTreasure)
            if wake is not None:
                assert wake != "too_early"
                assert [ev.type for ev in events][:1] == (["RoomTreasureOpened"] if wake == "open" else [])
        event(f"{cmd.name}: {type(error).__name__ if error else ('changed' if events else 'no-op')}")
        for ev in events:
            event(ev.type)
        if [ev.type for ev in events] == ["RoomTreasureOpened", "RoomTreasureCountdownStarted"]:
            event("treasure: opening chained the next countdown")
        if utc_day(now_ms) > before.treasure.day and before.treasure.day and before.treasure.box is not None:
            event("treasure: a pending box met a new UTC day")
        assert state is not None

        # Version: +1 for a command with events (all sharing it), unchanged otherwise.
        if events:
            assert state.version == before.version + 1
            assert {ev.room_version for ev in events} == {state.version}
            assert all(ev.occurred_at_ms == now_ms for ev in events)
            assert all((ev.app_code, ev.room_id) == (APP, ROOM) for ev in events)
        else:
            assert state.to_dict() == before_dict
        for ev in events:
            p = ev.payload
            if isinstance(p, e.RoomGiftSent):
                assert p.unit_price == RULES.gifts[p.gift_id].price
                assert p.total_value == p.unit_price * p.count
            if isinstance(p, e.RoomTreasureOpened):
                assert p.recipients == tuple(before.members)[:MAX_TREASURE_RECIPIENTS]
            if isinstance(p, e.RoomTreasureCountdownStarted):
                assert p.open_at_ms == now_ms + RULES.treasure_countdown_ms
                assert p.open_command_id == f"treasure-open:{p.box_id}"
            if isinstance(p, e.RoomUserKicked):
                assert p.banned_until_ms == now_ms + p.ban_seconds * 1000
        log.extend(events)
        check_invariants(state, log, now_ms)
