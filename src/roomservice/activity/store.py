"""The reference activity service's persistence: processed event ids, daily gift boards, treasure rewards.

Idempotency is the primary key of ``activity_processed_event``. Handling an
event is ONE write transaction (shared with the events handled together) that
first inserts its event id with ``INSERT OR IGNORE`` / ``INSERT IGNORE`` and then
applies the effect. A row ignored by that first statement (rowcount 0) means the
event was already processed (or is being processed right now by a concurrent
call: on MySQL/MariaDB the second insert waits for the first transaction's row
lock and is then ignored): nothing of it is written and the call reports a
duplicate. So one event id has its effect exactly once, even under concurrent
duplicates, on both backends.

The id recorded is :func:`~roomservice.domain.events.dedup_id`: a repair event
(``repair_of = X``, written by ``outbox replay --as-repair`` under a new
event id) IS event X here. If X was applied the repair is a duplicate; if X
never arrived the repair applies X's effect once, and X arriving later is the
duplicate. So an operator's repair can never add a gift's points twice.

Effects:

* ``RoomGiftSent`` adds ``total_value`` to the UTC day's (``utc_day(occurred_at_ms)``)
  board ``sent`` of the sender and board ``received`` of the receiver (an upsert:
  ``ON CONFLICT DO UPDATE`` on SQLite, ``ON DUPLICATE KEY UPDATE`` on MySQL).
* ``RoomTreasureOpened`` writes one reward row per recipient (``box_id``, ``level``,
  ``event_id``: the original's for a repair); a box that already paid a recipient
  does not pay that recipient again.
* Any other known event type is recorded as processed, with no further effect.

Statements are built once (per dialect, at construction); each operation is one
synchronous unit for :meth:`Database.run_write` / :meth:`Database.run_read`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from sqlalchemy import Connection, Insert, Row, Select, bindparam, select
from sqlalchemy.dialects import mysql, sqlite

from roomservice.clock import wall_clock_ms
from roomservice.coalesce import Coalesced, Failed
from roomservice.domain.events import Event, RoomGiftSent, RoomTreasureOpened, dedup_id
from roomservice.domain.state import utc_day
from roomservice.store.database import Database, execute_rendered, insert_or_ignore
from roomservice.store.tables import activity_gift_board, activity_processed_event, activity_treasure_reward

Board = Literal["sent", "received"]
BOARDS: Final[frozenset[str]] = frozenset({"sent", "received"})

_processed, _board, _reward = activity_processed_event, activity_gift_board, activity_treasure_reward

# OR IGNORE / IGNORE: a processed event is refused by its key, the rowcount (0) says so, and the
# transaction carries on without a savepoint per event; the row's values are ours (never NULL)
_INSERT_PROCESSED: Final = insert_or_ignore(_processed)

_IS_PROCESSED: Final = select(_processed.c.event_id).where(_processed.c.event_id == bindparam("event_id"))

_LEADERBOARD: Final = (
    select(_board.c.user_id, _board.c.value)
    .where(
        _board.c.app_code == bindparam("app_code"),
        _board.c.room_id == bindparam("room_id"),
        _board.c.day == bindparam("day"),
        _board.c.board == bindparam("board"),
    )
    .order_by(_board.c.value.desc(), _board.c.user_id)
    .limit(bindparam("limit"))
)

_REWARDS_OF_ROOM: Final = (
    select(_reward.c.box_id, _reward.c.level, _reward.c.user_id, _reward.c.event_id)
    .where(_reward.c.app_code == bindparam("app_code"), _reward.c.room_id == bindparam("room_id"))
    .order_by(_reward.c.created_at_ms, _reward.c.box_id, _reward.c.user_id)
)
_REWARDS_OF_BOX: Final = _REWARDS_OF_ROOM.where(_reward.c.box_id == bindparam("box_id"))


def _board_upsert(dialect: Literal["sqlite", "mysql"]) -> Insert:
    if dialect == "sqlite":
        lite = sqlite.insert(_board)
        return lite.on_conflict_do_update(
            index_elements=list(_board.primary_key.columns),
            set_={"value": _board.c.value + lite.excluded.value, "updated_at_ms": lite.excluded.updated_at_ms},
        )
    my = mysql.insert(_board)
    return my.on_duplicate_key_update(
        value=_board.c.value + my.inserted.value,
        updated_at_ms=my.inserted.updated_at_ms,
    )


@dataclass(frozen=True, slots=True)
class LeaderboardEntry:
    user_id: str
    value: int


@dataclass(frozen=True, slots=True)
class TreasureReward:
    box_id: str
    level: int
    user_id: str
    event_id: str


_Effect = tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]  # processed row, board rows, rewards


class _AlreadyProcessed(Exception):
    """Raised inside the write unit to roll its transaction back."""


class ActivityStore:
    """The activity service's tables on a :class:`Database`."""

    def __init__(self, db: Database, *, clock: Callable[[], int] = wall_clock_ms) -> None:
        self.db = db
        self.clock = clock
        self._upsert_board = _board_upsert(db.dialect_name)
        self._insert_rewards = db.insert_ignoring_duplicates(_reward)
        # events handled together (the consumer group runs 8 at a time) share one write transaction
        self._events: Coalesced[_Effect, None] = Coalesced(db, self._handle_all)

    async def handle(self, event: Event) -> bool:
        """Record ``event`` and apply its effect once; ``False`` if its event (its original, for
        a repair: :func:`dedup_id`) was already processed.

        Raises :class:`~roomservice.store.port.StoreUnavailable` when the database does not answer.
        """
        now = self.clock()
        processed = {"event_id": dedup_id(event), "event_type": event.type, "processed_at_ms": now}
        board_rows = _board_rows(event, now)
        reward_rows = _reward_rows(event, now)
        try:
            await self._events.submit((processed, board_rows, reward_rows))
        except _AlreadyProcessed:
            return False
        return True

    def _handle_all(self, conn: Connection, items: list[_Effect]) -> list[Failed | None]:
        """Several events in one transaction: one processed already fails alone, having written nothing
        (its processed row is the first statement, and it was ignored)."""
        outcomes: list[Failed | None] = []
        for processed, board_rows, reward_rows in items:
            try:
                _handle(conn, processed, self._upsert_board, board_rows, self._insert_rewards, reward_rows)
            except _AlreadyProcessed as exc:
                outcomes.append(Failed(exc))
            else:
                outcomes.append(None)
        return outcomes

    async def gift_leaderboard(
        self, app_code: str, room_id: str, *, day: int, board: Board, limit: int
    ) -> list[LeaderboardEntry]:
        params = {"app_code": app_code, "room_id": room_id, "day": day, "board": board, "limit": limit}
        rows = await self.db.run_read(_all_rows, _LEADERBOARD, params)
        return [LeaderboardEntry(user_id=r.user_id, value=int(r.value)) for r in rows]

    async def treasure_rewards(self, app_code: str, room_id: str, *, box_id: str | None = None) -> list[TreasureReward]:
        params: dict[str, Any] = {"app_code": app_code, "room_id": room_id}
        statement = _REWARDS_OF_ROOM
        if box_id:
            statement, params["box_id"] = _REWARDS_OF_BOX, box_id
        rows = await self.db.run_read(_all_rows, statement, params)
        return [TreasureReward(box_id=r.box_id, level=r.level, user_id=r.user_id, event_id=r.event_id) for r in rows]

    async def is_processed(self, event_id: str) -> bool:
        rows = await self.db.run_read(_all_rows, _IS_PROCESSED, {"event_id": event_id})
        return bool(rows)


# --------------------------------------------------------------------------- rows


def _board_rows(event: Event, now: int) -> list[dict[str, Any]]:
    payload = event.payload
    if not isinstance(payload, RoomGiftSent):
        return []
    key = {"app_code": event.app_code, "room_id": event.room_id, "day": utc_day(event.occurred_at_ms)}
    value = {"value": payload.total_value, "updated_at_ms": now}
    return [
        {**key, "board": "sent", "user_id": payload.sender_id, **value},
        {**key, "board": "received", "user_id": payload.receiver_id, **value},
    ]


def _reward_rows(event: Event, now: int) -> list[dict[str, Any]]:
    payload = event.payload
    if not isinstance(payload, RoomTreasureOpened):
        return []
    return [
        {
            "app_code": event.app_code,
            "room_id": event.room_id,
            "box_id": payload.box_id,
            "user_id": user_id,
            "level": payload.level,
            "event_id": dedup_id(event),
            "created_at_ms": now,
        }
        for user_id in dict.fromkeys(payload.recipients)  # unique, in order
    ]


# --------------------------------------------------------------------------- transaction units


def _handle(
    conn: Connection,
    processed: dict[str, Any],
    upsert_board: Insert,
    board_rows: list[dict[str, Any]],
    insert_rewards: Insert,
    reward_rows: list[dict[str, Any]],
) -> None:
    if execute_rendered(conn, _INSERT_PROCESSED, processed).rowcount == 0:
        # the event_id primary key: processed already (in this transaction, or committed before it)
        raise _AlreadyProcessed(processed["event_id"])
    if board_rows:
        conn.execute(upsert_board, board_rows)
    if reward_rows:
        conn.execute(insert_rewards, reward_rows)


def _all_rows(conn: Connection, statement: Select[Any], params: dict[str, Any]) -> Sequence[Row[Any]]:
    return conn.execute(statement, params).all()
