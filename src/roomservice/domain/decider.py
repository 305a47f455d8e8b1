"""The Decider: ``decide(state, command) -> payloads`` and ``evolve(state, event) -> state``.

Both are pure. ``decide`` reads the clock only through ``now_ms`` and never
mutates its input; recovery replays logged events through ``evolve`` and never
re-decides.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from roomservice import errors
from roomservice.domain import commands as c
from roomservice.domain import events as e
from roomservice.domain import limits as lim
from roomservice.domain.rules import RoomRules
from roomservice.domain.state import (
    CLOSED,
    PendingBox,
    RoomState,
    TreasureState,
    day_label,
    utc_day,
)

Payloads = list[e.EventPayload]


def decide(state: RoomState | None, command: c.Command, *, now_ms: int, rules: RoomRules) -> Payloads:
    """The events ``command`` causes on ``state``; raises a DomainError if a rule forbids it.

    An empty list is a no-op: it succeeds without changing the room.
    """
    if isinstance(command, c.CreateRoom):
        return _create(state, command, rules)
    if state is None:
        raise errors.RoomNotFound()
    if isinstance(command, c.OpenTreasure):
        return _open_treasure(state, command, now_ms, rules)
    if state.status == CLOSED:
        raise errors.RoomClosed()
    if isinstance(command, c.JoinRoom):
        return _join(state, command, now_ms)
    if isinstance(command, c.LeaveRoom):
        return _leave(state, command)
    if isinstance(command, c.TakeMic):
        return _take_mic(state, command)
    if isinstance(command, c.LeaveMic):
        seat = state.seat_of(command.user_id)
        return [] if seat is None else [e.RoomMicLeft(user_id=command.user_id, seat=seat)]
    if isinstance(command, c.SendGift):
        return _send_gift(state, command, now_ms, rules)
    if isinstance(command, c.KickUser):
        return _kick(state, command, now_ms, rules)
    if isinstance(command, c.CloseRoom):
        if command.operator_id != state.owner_id:
            raise errors.NotAllowed("only the owner may close the room")
        return [e.RoomClosed(operator_id=command.operator_id)]
    raise errors.InvalidArgument(f"unknown command {type(command).__name__}")


def _create(state: RoomState | None, command: c.CreateRoom, rules: RoomRules) -> Payloads:
    if state is not None:
        raise errors.RoomExists()
    if (problem := lim.title_problem(command.title)) is not None:
        raise errors.InvalidArgument(problem)
    seat_count = rules.default_seat_count if command.seat_count is None else command.seat_count
    _within("seat_count", seat_count, lim.SEAT_COUNT_MIN, lim.SEAT_COUNT_MAX)
    return [e.RoomCreated(owner_id=command.owner_id, title=command.title, seat_count=seat_count)]


def _within(name: str, value: int, low: int, high: int) -> None:
    """The numeric limits of SPEC §3 hold here too, not only at the HTTP edge."""
    if not low <= value <= high:
        raise errors.InvalidArgument(f"{name} must be in {low}..{high}")


def _join(state: RoomState, command: c.JoinRoom, now_ms: int) -> Payloads:
    if state.banned_until(command.user_id, now_ms) is not None:
        raise errors.UserBanned()
    if state.is_member(command.user_id):
        return []
    return [e.RoomUserJoined(user_id=command.user_id, role=state.role_of(command.user_id))]


def _leave(state: RoomState, command: c.LeaveRoom) -> Payloads:
    if not state.is_member(command.user_id):
        return []
    return [*_vacate_seat(state, command.user_id), e.RoomUserLeft(user_id=command.user_id)]


def _vacate_seat(state: RoomState, user_id: str) -> Payloads:
    seat = state.seat_of(user_id)
    return [] if seat is None else [e.RoomMicLeft(user_id=user_id, seat=seat)]


def _take_mic(state: RoomState, command: c.TakeMic) -> Payloads:
    if not state.is_member(command.user_id):
        raise errors.NotMember()
    if not 0 <= command.seat < state.seat_count:
        raise errors.InvalidArgument(f"seat must be in 0..{state.seat_count - 1}")
    holder = state.seats[command.seat]
    if holder == command.user_id:
        return []
    if holder is not None:
        raise errors.SeatTaken()
    return [*_vacate_seat(state, command.user_id), e.RoomMicTaken(user_id=command.user_id, seat=command.seat)]


def _send_gift(state: RoomState, command: c.SendGift, now_ms: int, rules: RoomRules) -> Payloads:
    _within("count", command.count, lim.GIFT_COUNT_MIN, lim.GIFT_COUNT_MAX)
    gift = rules.gifts.get(command.gift_id)
    if gift is None:
        raise errors.UnknownGift()
    if not state.is_member(command.sender_id):
        raise errors.NotMember("sender is not a member of the room")
    if not state.is_member(command.receiver_id):
        raise errors.NotMember("receiver is not a member of the room")
    total = gift.price * command.count
    sent = e.RoomGiftSent(
        sender_id=command.sender_id,
        receiver_id=command.receiver_id,
        gift_id=gift.id,
        count=command.count,
        unit_price=gift.price,
        total_value=total,
    )
    day = utc_day(now_ms)
    treasure = state.treasure.on_day(day)
    treasure = TreasureState(day=day, energy=treasure.energy + total, opened=treasure.opened, box=treasure.box)
    return [sent, *_maybe_start_countdown(treasure, now_ms, rules)]


def _maybe_start_countdown(treasure: TreasureState, now_ms: int, rules: RoomRules) -> Payloads:
    """Start the next level's box if the day's energy reaches it and none counts down."""
    levels = rules.treasure_levels
    if treasure.box is not None or treasure.opened >= len(levels):
        return []
    if treasure.energy < levels[treasure.opened]:
        return []
    level = treasure.opened + 1
    box_id = f"{day_label(treasure.day)}-{level}"
    return [
        e.RoomTreasureCountdownStarted(
            box_id=box_id,
            level=level,
            open_at_ms=now_ms + rules.treasure_countdown_ms,
            open_command_id=c.treasure_open_command_id(box_id),
        )
    ]


def _open_treasure(state: RoomState, command: c.OpenTreasure, now_ms: int, rules: RoomRules) -> Payloads:
    """Re-validate a wake-up; stale, duplicate and closed-room wake-ups are no-ops."""
    if state.status == CLOSED:
        return []
    treasure = state.treasure.on_day(utc_day(now_ms))
    box = treasure.box
    if box is None or (box.box_id, box.level, box.open_at_ms) != (
        command.box_id,
        command.level,
        command.open_at_ms,
    ):
        return []
    if now_ms < box.open_at_ms:
        raise errors.TreasureTooEarly(box.open_at_ms)
    recipients = tuple(state.members)[: lim.MAX_TREASURE_RECIPIENTS]
    opened = e.RoomTreasureOpened(box_id=box.box_id, level=box.level, recipients=recipients)
    after = TreasureState(day=treasure.day, energy=treasure.energy, opened=box.level, box=None)
    return [opened, *_maybe_start_countdown(after, now_ms, rules)]


def _kick(state: RoomState, command: c.KickUser, now_ms: int, rules: RoomRules) -> Payloads:
    if command.operator_id != state.owner_id:
        raise errors.NotAllowed("only the owner may kick")
    if command.target_id == state.owner_id:
        raise errors.NotAllowed("the owner cannot be kicked")
    if not state.is_member(command.target_id):
        raise errors.NotMember()
    ban_seconds = rules.default_ban_seconds if command.ban_seconds is None else command.ban_seconds
    _within("ban_seconds", ban_seconds, lim.BAN_SECONDS_MIN, lim.BAN_SECONDS_MAX)
    return [
        *_vacate_seat(state, command.target_id),
        e.RoomUserKicked(
            operator_id=command.operator_id,
            target_id=command.target_id,
            ban_seconds=ban_seconds,
            banned_until_ms=now_ms + ban_seconds * 1000,
        ),
    ]


# --------------------------------------------------------------------------- evolve


def evolve(state: RoomState | None, event: e.Event) -> RoomState:
    """The state after ``event``; the version becomes the event's room_version."""
    p = event.payload
    if isinstance(p, e.RoomCreated):
        return RoomState(
            app_code=event.app_code,
            room_id=event.room_id,
            owner_id=p.owner_id,
            title=p.title,
            seat_count=p.seat_count,
            created_at_ms=event.occurred_at_ms,
            version=event.room_version,
            members={p.owner_id: event.occurred_at_ms},
            seats=(None,) * p.seat_count,
        )
    if state is None:
        raise ValueError(f"{p.type} before RoomCreated in {event.app_code}/{event.room_id}")
    version = event.room_version  # set together with the change: one copy of the state per event
    if isinstance(p, e.RoomUserJoined):
        bans = state.bans
        if p.user_id in bans:
            bans = {u: t for u, t in bans.items() if u != p.user_id}
        return state.with_(version=version, members={**state.members, p.user_id: event.occurred_at_ms}, bans=bans)
    if isinstance(p, e.RoomUserLeft):
        return state.with_(version=version, members=_without(state.members, p.user_id))
    if isinstance(p, e.RoomMicTaken):
        return state.with_(version=version, seats=_set_seat(state.seats, p.seat, p.user_id))
    if isinstance(p, e.RoomMicLeft):
        return state.with_(version=version, seats=_set_seat(state.seats, p.seat, None))
    if isinstance(p, e.RoomGiftSent):
        t = state.treasure.on_day(utc_day(event.occurred_at_ms))
        return state.with_(
            version=version,
            heat=state.heat + p.total_value,
            treasure=TreasureState(day=t.day, energy=t.energy + p.total_value, opened=t.opened, box=t.box),
        )
    if isinstance(p, e.RoomUserKicked):
        return state.with_(
            version=version,
            members=_without(state.members, p.target_id),
            bans={**state.bans, p.target_id: p.banned_until_ms},
        )
    if isinstance(p, e.RoomClosed):  # a box mid-countdown never opens
        t = state.treasure
        closed = TreasureState(day=t.day, energy=t.energy, opened=t.opened)
        return state.with_(version=version, status=CLOSED, treasure=closed)
    if isinstance(p, e.RoomTreasureCountdownStarted):
        t = state.treasure.on_day(utc_day(event.occurred_at_ms))
        box = PendingBox(box_id=p.box_id, level=p.level, open_at_ms=p.open_at_ms)
        counting = TreasureState(day=t.day, energy=t.energy, opened=t.opened, box=box)
        return state.with_(version=version, treasure=counting)
    if isinstance(p, e.RoomTreasureOpened):
        t = state.treasure.on_day(utc_day(event.occurred_at_ms))
        opened = TreasureState(day=t.day, energy=t.energy, opened=p.level, box=None)
        return state.with_(version=version, treasure=opened)
    raise ValueError(f"unknown event type {p.type}")


def _without(members: dict[str, int], user_id: str) -> dict[str, int]:
    return {u: at for u, at in members.items() if u != user_id}


def _set_seat(seats: tuple[str | None, ...], index: int, holder: str | None) -> tuple[str | None, ...]:
    return (*seats[:index], holder, *seats[index + 1 :])


def stamp(
    payloads: Sequence[e.EventPayload],
    *,
    state: RoomState | None,
    app_code: str,
    room_id: str,
    now_ms: int,
    new_event_id: Callable[[], str],
) -> list[e.Event]:
    """Wrap a decision's payloads in envelopes; all of one command share the next version."""
    version = (0 if state is None else state.version) + 1
    return [
        e.Event(
            event_id=new_event_id(),
            app_code=app_code,
            room_id=room_id,
            room_version=version,
            occurred_at_ms=now_ms,
            payload=p,
        )
        for p in payloads
    ]


def replay(state: RoomState | None, events: Iterable[e.Event]) -> RoomState | None:
    for event in events:
        state = evolve(state, event)
    return state
