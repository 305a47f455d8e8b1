"""Shared fixtures for the pure room domain: rules, a fixed clock and a small room harness.

The harness applies a command the way the Room Cell does: ``decide`` on the
current state, ``stamp`` the payloads with the next version, ``evolve`` over the
events. Tests talk to it instead of repeating that plumbing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import pytest

from roomservice.domain import commands as c
from roomservice.domain import events as e
from roomservice.domain.decider import decide, evolve, replay, stamp
from roomservice.domain.rules import Gift, RoomRules
from roomservice.domain.state import RoomState

APP = "app_1"
ROOM = "room-1"
OWNER = "owner"
ALICE = "alice"
BOB = "bob"
CAROL = "carol"

# 2024-03-10 12:00:00 UTC: mid-day, far from the treasure reset boundary.
NOON_MS = int(datetime(2024, 3, 10, 12, tzinfo=UTC).timestamp() * 1000)
MIDNIGHT_MS = int(datetime(2024, 3, 11, tzinfo=UTC).timestamp() * 1000)
DAY1 = "20240310"
DAY2 = "20240311"

GIFTS = {
    "rose": Gift(id="rose", name="Rose", price=10),
    "heart": Gift(id="heart", name="Heart", price=100),
    "rocket": Gift(id="rocket", name="Rocket", price=1000),
    "castle": Gift(id="castle", name="Castle", price=5000),
}
RULES = RoomRules(
    gifts=GIFTS,
    default_seat_count=8,
    default_ban_seconds=600,
    treasure_levels=(1000, 5000, 20000),
    treasure_countdown_ms=60_000,
)


class Room:
    """One room driven through decide -> stamp -> evolve, with a manual clock.

    Tests reach the shared constants through the class (``room.NOON_MS``,
    ``room.DAY1``...) so no test module imports this conftest.
    """

    APP = APP
    ROOM = ROOM
    NOON_MS = NOON_MS
    MIDNIGHT_MS = MIDNIGHT_MS
    DAY1 = DAY1
    DAY2 = DAY2

    def __init__(self, *, rules: RoomRules = RULES, now_ms: int = NOON_MS) -> None:
        self.rules = rules
        self.now_ms = now_ms
        self.state: RoomState | None = None
        self.log: list[e.Event] = []
        self._ids: Iterator[int] = itertools.count(1)

    # -- driving ---------------------------------------------------------------

    def decide(self, command: c.Command) -> list[e.EventPayload]:
        return decide(self.state, command, now_ms=self.now_ms, rules=self.rules)

    def send(self, command: c.Command) -> list[e.Event]:
        """Apply ``command``; a DomainError propagates and leaves the room as it was."""
        before = None if self.state is None else self.state.to_dict()
        try:
            payloads = self.decide(command)
        except Exception:
            assert (None if self.state is None else self.state.to_dict()) == before
            raise
        assert (None if self.state is None else self.state.to_dict()) == before, "decide mutated state"
        events = stamp(
            payloads,
            state=self.state,
            app_code=APP,
            room_id=ROOM,
            now_ms=self.now_ms,
            new_event_id=lambda: f"ev-{next(self._ids)}",
        )
        for event in events:
            self.state = evolve(self.state, event)
        self.log.extend(events)
        return events

    def payloads(self, command: c.Command) -> list[e.EventPayload]:
        """Apply ``command`` and return just the payloads."""
        return [event.payload for event in self.send(command)]

    def advance(self, ms: int) -> None:
        self.now_ms += ms

    def at(self, ms: int) -> None:
        self.now_ms = ms

    # -- shortcuts -------------------------------------------------------------

    def create(self, owner: str = OWNER, title: str = "Room", seat_count: int | None = None) -> list[e.Event]:
        return self.send(c.CreateRoom(owner_id=owner, title=title, seat_count=seat_count))

    def join(self, *users: str) -> None:
        for user in users:
            self.send(c.JoinRoom(user_id=user))

    def gift(self, sender: str, receiver: str, gift_id: str, count: int = 1) -> list[e.EventPayload]:
        return self.payloads(c.SendGift(sender_id=sender, receiver_id=receiver, gift_id=gift_id, count=count))

    def open_box(self) -> list[e.EventPayload]:
        """Wake the pending box at its open_at_ms (the clock moves there)."""
        box = self.live.treasure.box
        assert box is not None, "no pending box"
        self.at(max(self.now_ms, box.open_at_ms))
        return self.payloads(c.OpenTreasure(box_id=box.box_id, level=box.level, open_at_ms=box.open_at_ms))

    @property
    def live(self) -> RoomState:
        assert self.state is not None
        return self.state

    @property
    def version(self) -> int:
        return 0 if self.state is None else self.state.version

    def replayed(self) -> RoomState | None:
        return replay(None, self.log)


@pytest.fixture
def make_room() -> Callable[..., Room]:
    """A factory for rooms with other rules or another start time."""
    return Room


@pytest.fixture
def room() -> Room:
    """A room that does not exist yet."""
    return Room()


@pytest.fixture
def open_room() -> Room:
    """An open room: the owner plus alice and bob as members (join order owner, alice, bob)."""
    r = Room()
    r.create()
    r.join(ALICE, BOB)
    return r
