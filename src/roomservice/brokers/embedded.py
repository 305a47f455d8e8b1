"""The embedded broker: the :class:`~roomservice.brokers.port.Broker` port inside the service's own database.

Nothing to install: the queue lives in three tables of the database the
service already has (SQLite in the embedded default, MySQL/MariaDB when
configured; migration ``0003``), so a publish is durable once its transaction
commits, and several processes on one database share the queue.

* ``broker_message`` — each message once per (topic, key) for as long as it is
  retained: publishing a retained key again stores nothing and returns the
  first message's id (duplicate suppression).
* ``broker_group`` — the declared consumer groups, each with its topic and
  ``max_deliveries``.
* ``broker_delivery`` — one row per (group, message) the group has not
  acknowledged: ``ready`` (held until ``visible_at_ms``: a delay, a nack's
  delay, or the visibility timeout of the delivery in flight, whose
  ``receipt`` it carries) or ``dead`` (the group's dead letter). A publish
  writes the message and a row for every group of its topic in one
  transaction; a newly declared group gets a row for every message its topic
  retains. An ack deletes the row; groups never share rows, so they never
  steal each other's messages.

Fetching claims rows the way the outbox worker claims its rows (a short write
transaction, statements built once at import): SQLite runs one ``UPDATE …
RETURNING`` under ``BEGIN IMMEDIATE`` (one writer at a time, across processes
too), and this process's publishes, acks and claims that queue together share
one such transaction (the groups a publish wakes claim together, right after
it); MySQL/MariaDB a ``SELECT … FOR UPDATE SKIP LOCKED`` then ``UPDATE`` by key
(READ COMMITTED), a transaction of its own per claim, so concurrent fetchers
skip each other's rows instead of waiting. A claim gives each row ``visible_at = now + visibility``, a fresh
receipt and ``delivery_count + 1``; a row that already had its last delivery
(the consumer crashed, or never answered) goes to the dead letter in the same
claim instead. Ack and nack are guarded by the receipt: a delivery that came
back since (a stale receipt) changes nothing. A fetch with nothing to hand out
polls every ``poll_interval``; a publish (or replay) in this process wakes its
waiting fetches at once.

Retention (:meth:`EmbeddedBroker.purge`, run by the maintenance role): dead
letters and unacknowledged rows untouched since ``before_ms`` (a stopped
group's backlog), then messages no group needs any more and published before
``before_ms``; bounded per call, oldest first. A stopped group's backlog is
therefore kept for the whole retention, and a duplicate publish is suppressed
for as long as its message is retained.

Times (``published_at_ms``, delays, visibility) are the injected clock's
milliseconds (the wall clock by default): processes sharing one database must
agree on the time, as they do for the outbox.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from sqlalchemy import (
    BigInteger,
    Connection,
    Row,
    String,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal,
    null,
    select,
    text,
    update,
)

from roomservice.brokers.port import (
    BrokerError,
    BrokerUnavailable,
    DeadLetter,
    Delivery,
    GroupStats,
    OutgoingMessage,
    within,
)
from roomservice.clock import wall_clock_ms
from roomservice.coalesce import Coalesced, Failed
from roomservice.config import EmbeddedBrokerConfig
from roomservice.futures import relay
from roomservice.observability.logging import get_logger
from roomservice.store.database import Database, insert_or_ignore
from roomservice.store.port import StoreUnavailable
from roomservice.store.tables import broker_delivery, broker_group, broker_message

T = TypeVar("T")

NAME_MAX_CHARS: Final = 128  # topic, group and key: ASCII (case-sensitive on MySQL)
LABEL_MAX_CHARS: Final = 255  # tag and sharding key
# A message body's limit, as NATS' default max_payload: an outbox envelope is a few KiB at most. A body
# past MariaDB's max_allowed_packet failed its whole publish batch as "unavailable" and was retried.
BODY_MAX_BYTES: Final = 1024 * 1024
LAST_ERROR_MAX_CHARS: Final = 2000
RECEIPT_BYTES: Final = 16  # 32 hex characters
CRASHED_REASON: Final = "no ack within the visibility timeout of its last delivery"
FAILED_REASON: Final = "failed on its last delivery"

_READY: Final = "ready"
_DEAD: Final = "dead"

_log = get_logger("roomservice.brokers.embedded")

_m = broker_message.c
_g = broker_group.c
_d = broker_delivery.c

# --------------------------------------------------------------------------- publish and groups

_INSERT_MESSAGE: Final = insert_or_ignore(broker_message)
_MESSAGE_ID: Final = select(_m.id).where(_m.topic == bindparam("b_topic"), _m.msg_key == bindparam("b_key"))
_DELIVERY_COLUMNS: Final = ["group_name", "message_id", "state", "delivery_count", "visible_at_ms"]
# One row for every group of the topic: the publish's fan-out.
_FAN_OUT: Final = insert(broker_delivery).from_select(
    _DELIVERY_COLUMNS,
    select(
        _g.group_name,
        bindparam("b_id", type_=BigInteger()),
        literal(_READY),
        literal(0),
        bindparam("b_visible", type_=BigInteger()),
    )
    .where(_g.topic == bindparam("b_topic"))
    .with_for_update(read=True),  # see _BACKFILL
)
_GROUP: Final = select(_g.topic, _g.max_deliveries).where(_g.group_name == bindparam("b_group"))
_INSERT_GROUP: Final = insert_or_ignore(broker_group)
_SET_MAX_DELIVERIES: Final = (
    update(broker_group).where(_g.group_name == bindparam("b_group")).values(max_deliveries=bindparam("b_max"))
)
# A new group gets what its topic retains, held ones still held.
# On MySQL/MariaDB (READ COMMITTED) both this and the fan-out read with shared locks: a plain read
# skips what another transaction inserted and has not committed, so a group declared while a
# message of its topic was being published got it from neither. A locking read waits for that
# insert's commit and sees it; the two waiting for each other is a deadlock, which rolls one back
# (the publish or the declare fails as unavailable, and is tried again). SQLite: one writer at a
# time, and no FOR UPDATE.
_BACKFILL: Final = insert_or_ignore(broker_delivery).from_select(
    _DELIVERY_COLUMNS,
    select(
        bindparam("b_group", type_=String()),
        _m.id,
        literal(_READY),
        literal(0),
        func.coalesce(_m.deliver_at_ms, _m.published_at_ms),
    )
    .where(_m.topic == bindparam("b_topic"))
    .with_for_update(read=True),
)

# --------------------------------------------------------------------------- claim

_OF_GROUP: Final = _d.group_name == bindparam("b_group")
# The group's topic and when its next ready row is due (NULL: none), by the claim's index.
_NEXT_DUE: Final = select(
    _g.topic,
    select(func.min(_d.visible_at_ms))
    .where(_d.group_name == _g.group_name, _d.state == _READY)
    .correlate(broker_group)
    .scalar_subquery(),
).where(_g.group_name == bindparam("b_group"))
_CLAIMABLE: Final = (_d.state == _READY) & (_d.visible_at_ms <= bindparam("b_now"))
_HAD_LAST: Final = _d.delivery_count >= bindparam("b_max")

# SQLite: the first b_limit visible rows, each either handed out or (after its
# last delivery) buried, in one statement. SET reads the old values throughout.
SQLITE_CLAIM: Final = (
    update(broker_delivery)
    .where(
        _OF_GROUP,
        _d.message_id.in_(
            select(_d.message_id)
            .where(_OF_GROUP, _CLAIMABLE)
            .order_by(_d.visible_at_ms, _d.message_id)
            .limit(bindparam("b_limit"))
        ),
    )
    .values(
        state=case((_HAD_LAST, _DEAD), else_=_READY),
        delivery_count=case((_HAD_LAST, _d.delivery_count), else_=_d.delivery_count + 1),
        visible_at_ms=case((_HAD_LAST, bindparam("b_now")), else_=bindparam("b_until")),
        receipt=case((_HAD_LAST, null()), else_=bindparam("b_receipt")),
        last_error=case((_HAD_LAST, CRASHED_REASON), else_=_d.last_error),
        dead_at_ms=case((_HAD_LAST, bindparam("b_now")), else_=null()),
    )
    .returning(_d.message_id, _d.state, _d.delivery_count)
)

# MySQL/MariaDB: lock the first visible rows, skipping those another fetcher is
# claiming, then bury or hand out by key (MySQL's SET reads the new values left
# to right: two plain statements rather than one with CASEs).
MYSQL_CLAIM: Final = (
    select(_d.message_id, _d.delivery_count)
    .where(_OF_GROUP, _CLAIMABLE)
    .order_by(_d.visible_at_ms, _d.message_id)
    .limit(bindparam("b_limit"))
    .with_for_update(skip_locked=True)
)
_IDS_OF_GROUP: Final = (_OF_GROUP, _d.message_id.in_(bindparam("b_ids", expanding=True)))
_MYSQL_HAND_OUT: Final = (
    update(broker_delivery)
    .where(*_IDS_OF_GROUP)
    .values(
        delivery_count=_d.delivery_count + 1,
        visible_at_ms=bindparam("b_until"),
        receipt=bindparam("b_receipt"),
    )
)
_MYSQL_BURY: Final = (
    update(broker_delivery)
    .where(*_IDS_OF_GROUP)
    .values(
        state=_DEAD,
        visible_at_ms=bindparam("b_now"),
        dead_at_ms=bindparam("b_now"),
        receipt=null(),
        last_error=CRASHED_REASON,
    )
)

_MESSAGES: Final = select(
    _m.id, _m.topic, _m.msg_key, _m.tag, _m.sharding_key, _m.headers, _m.body, _m.published_at_ms
).where(_m.id.in_(bindparam("b_ids", expanding=True)))

# --------------------------------------------------------------------------- ack, nack, dead letters

_CURRENT: Final = (
    _OF_GROUP,
    _d.message_id == bindparam("b_id"),
    _d.state == _READY,
    _d.receipt == bindparam("b_receipt"),
)
_ACK: Final = delete(broker_delivery).where(*_CURRENT)
_TOUCH: Final = update(broker_delivery).where(*_CURRENT).values(visible_at_ms=bindparam("b_visible"))
# Only delivery_count is read, and no assignment changes it: safe on MySQL too.
_NACK: Final = (
    update(broker_delivery)
    .where(*_CURRENT)
    .values(
        state=case((_HAD_LAST, _DEAD), else_=_READY),
        visible_at_ms=case((_HAD_LAST, bindparam("b_now")), else_=bindparam("b_visible")),
        dead_at_ms=case((_HAD_LAST, bindparam("b_now")), else_=null()),
        last_error=case((_HAD_LAST, bindparam("b_dead_reason")), else_=bindparam("b_error")),
        receipt=null(),
    )
)
_DEAD_LETTERS: Final = (
    select(
        _d.message_id,
        _d.delivery_count,
        _d.dead_at_ms,
        _d.last_error,
        _m.topic,
        _m.msg_key,
        _m.tag,
        _m.body,
        _m.headers,
    )
    .select_from(broker_delivery.join(broker_message, _m.id == _d.message_id))
    .where(_OF_GROUP, _d.state == _DEAD)
    .order_by(_d.visible_at_ms, _d.message_id)
    .limit(bindparam("b_limit"))
)
_REPLAY: Final = (
    update(broker_delivery)
    .where(_OF_GROUP, _d.message_id == bindparam("b_id"), _d.state == _DEAD)
    .values(
        state=_READY,
        delivery_count=0,
        visible_at_ms=bindparam("b_now"),
        receipt=null(),
        dead_at_ms=null(),
        last_error=null(),
    )
)
_IS_READY = _d.state == _READY
_STATS: Final = select(
    func.coalesce(func.sum(case((_IS_READY, 1), else_=0)), 0),
    func.coalesce(
        func.sum(case((_IS_READY & _d.receipt.is_not(None) & (_d.visible_at_ms > bindparam("b_now")), 1), else_=0)),
        0,
    ),
    func.coalesce(func.sum(case((_d.state == _DEAD, 1), else_=0)), 0),
).where(_OF_GROUP)
_PING: Final = text("SELECT 1")

# --------------------------------------------------------------------------- retention
# Deliveries by the (state, visible_at_ms) index, oldest first: a dead row's
# visible_at_ms is when it died; a ready row's when it was last due or handed out.
# Then messages no delivery row refers to, by id (oldest first).

_SQLITE_PURGE_DELIVERIES: Final = text(
    "DELETE FROM broker_delivery WHERE rowid IN (SELECT rowid FROM broker_delivery "
    "WHERE state = :b_state AND visible_at_ms < :b_before ORDER BY visible_at_ms LIMIT :b_limit)"
)
_MYSQL_PURGE_DELIVERIES: Final = text(
    "DELETE FROM broker_delivery WHERE state = :b_state AND visible_at_ms < :b_before "
    "ORDER BY visible_at_ms LIMIT :b_limit"
)
_UNNEEDED: Final = (
    "published_at_ms < :b_before AND COALESCE(deliver_at_ms, 0) < :b_before "
    "AND NOT EXISTS (SELECT 1 FROM broker_delivery d WHERE d.message_id = {table}.id)"
)
_SQLITE_PURGE_MESSAGES: Final = text(
    "DELETE FROM broker_message WHERE id IN (SELECT id FROM broker_message m WHERE "
    + _UNNEEDED.format(table="m")
    + " ORDER BY id LIMIT :b_limit)"
)
_MYSQL_PURGE_MESSAGES: Final = text(
    "DELETE FROM broker_message WHERE " + _UNNEEDED.format(table="broker_message") + " ORDER BY id LIMIT :b_limit"
)


# --------------------------------------------------------------------------- the adapter


class EmbeddedBroker:
    """The broker port on a :class:`Database`; the database is the caller's (not closed here)."""

    name = "embedded"

    def __init__(
        self,
        db: Database,
        *,
        config: EmbeddedBrokerConfig | None = None,
        clock: Callable[[], int] = wall_clock_ms,
    ) -> None:
        config = config or EmbeddedBrokerConfig()
        self.db = db
        self._poll_s = config.poll_interval.total_seconds()
        # For the maintenance role: purge(clock() - retention_ms, cleanup_batch_size) per pass.
        self.retention_ms = int(config.retention.total_seconds() * 1000)
        self.cleanup_batch_size = config.cleanup_batch_size
        self._clock = clock
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}  # fetches waiting, per topic
        self._busy_groups: set[str] = set()  # groups whose last claim in this process handed messages out
        self._closed = False
        # Publishes, acks and claims that arrive while the previous write is being written share the
        # next transaction. On SQLite (one writer) all three go through one queue: every separate
        # transaction costs a thread hop and a turn of the writer lock, and the groups a publish wakes
        # claim together, in the transaction after it, with the acks and publishes queued meanwhile.
        # On MySQL/MariaDB transactions do not wait for each other: publishes and acks have a queue
        # each and every claim its own transaction, as concurrent fetchers skip each other's rows.
        self._publishes: Coalesced[_Write, Any] = Coalesced(db, _write_all)
        self._acks = self._publishes if db.is_sqlite else Coalesced(db, _write_all)
        self._claims = self._publishes if db.is_sqlite else None

    # ------------------------------------------------------------------ publish

    async def publish(self, message: OutgoingMessage, *, timeout_s: float | None) -> str:
        item = self._outgoing(message)
        message_id, stored = await self._store(self._publishes.submit(_Publish(*item)), timeout_s)
        if stored:
            self._wake(message.topic)
        return str(message_id)

    async def send(self, message: OutgoingMessage) -> asyncio.Future[str]:
        """Pipelined publish (:class:`~roomservice.brokers.port.PipelinedBroker`): ``message`` is
        queued for the next shared publish transaction before this returns, behind every message
        queued before it; transactions commit in queue order, one at a time, so a room's rows keep
        their order while their acknowledgements are outstanding. The future is the message id once
        its transaction committed, or ``BrokerUnavailable`` as :meth:`publish` fails. A caller that
        cancels it gives up on knowing: the message may still be stored, and sent again (same key) it
        is stored once."""
        item = self._outgoing(message)
        topic = message.topic

        def stored(outcome: tuple[int, bool]) -> str:
            message_id, new = outcome
            if new:
                self._wake(topic)
            return str(message_id)

        return relay(self._publishes.submit_nowait(_Publish(*item)), stored, _unavailable)

    def _outgoing(self, message: OutgoingMessage) -> tuple[dict[str, Any], int]:
        """The checked row of ``message`` and when it becomes visible; raises BrokerError."""
        self._check_open()
        _check_name("topic", message.topic)
        _check_name("key", message.key)
        _check_label("tag", message.tag)
        _check_label("sharding_key", message.sharding_key)
        if len(message.body) > BODY_MAX_BYTES:
            raise BrokerError(f"message too large: {len(message.body)} bytes, at most {BODY_MAX_BYTES}")
        now = self._clock()
        values = {
            "topic": message.topic,
            "msg_key": message.key,
            "tag": message.tag,
            "sharding_key": message.sharding_key,
            "headers": json.dumps(dict(message.headers), sort_keys=True, separators=(",", ":")),
            "body": bytes(message.body),
            "deliver_at_ms": message.deliver_at_ms,
            "published_at_ms": now,
        }
        return values, now if message.deliver_at_ms is None else message.deliver_at_ms

    async def declare_group(self, topic: str, group: str, *, max_deliveries: int) -> None:
        self._check_open()
        _check_name("topic", topic)
        _check_name("group", group)
        if max_deliveries < 1:
            raise BrokerError("max_deliveries must be at least 1")
        await self._store(self.db.run_write(_declare, topic, group, max_deliveries, self._clock()))
        self._wake(topic)

    # ------------------------------------------------------------------ consume

    async def fetch(
        self, topic: str, group: str, *, max_messages: int, wait_s: float, visibility_s: float
    ) -> Sequence[Delivery]:
        self._check_open()
        if max_messages < 1:
            raise BrokerError("max_messages must be at least 1")
        if not visibility_s > 0:
            raise BrokerError("visibility_s must be > 0")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, wait_s)
        visibility_ms = max(1, round(visibility_s * 1000))
        while True:
            # Registered before looking: a publish meanwhile still wakes us.
            waiter = loop.create_future()
            waiters = self._waiters.setdefault(topic, set())
            waiters.add(waiter)
            try:
                now = self._clock()
                # A read first: an idle group costs no write transaction (SQLite's one writer). Unless the
                # group's last claim here handed messages out: then more are likely ready, and the claim
                # checks the group itself.
                busy = group in self._busy_groups
                due = now if busy else await self._store(self.db.run_read(_next_due, topic, group))
                if due is not None and due <= now:
                    params = {
                        "b_group": group,
                        "b_now": now,
                        "b_until": now + visibility_ms,
                        "b_receipt": secrets.token_hex(RECEIPT_BYTES),
                        "b_limit": max_messages,
                    }
                    got, buried = await self._store(self._claim(topic, params))
                    if got:
                        self._busy_groups.add(group)
                        return got
                    self._busy_groups.discard(group)
                    if buried:  # they made room for more: look again at once
                        _log.info("broker_dead_lettered", group=group, messages=buried, reason=CRASHED_REASON)
                        continue
                    if busy:  # nothing was ready after all: the read says when to look again
                        continue
                remaining = deadline - loop.time()
                if self._closed or remaining <= 0:
                    return []
                pause = min(remaining, self._poll_s)
                if due is not None and due > now:  # held, delayed or in flight until then
                    pause = min(pause, (due - now) / 1000)
                await asyncio.wait([waiter], timeout=pause)
            finally:
                waiters.discard(waiter)

    async def _claim(self, topic: str, params: dict[str, Any]) -> tuple[list[Delivery], int]:
        """Claim up to ``b_limit`` of the group's visible rows: (handed out, buried)."""
        if self._claims is not None:
            result: tuple[list[Delivery], int] = await self._claims.submit(_Claim(topic, params))
            return result
        return await self.db.run_write(_claim_mysql, topic, params)

    async def ack(self, delivery: Delivery) -> None:
        await self._store(self._acks.submit(_Ack(_receipt_params(delivery))))

    def ack_nowait(self, delivery: Delivery) -> asyncio.Future[None]:
        """:meth:`ack`, queued before this returns (no task of its own): acks queued together share
        one transaction, so the consumer runtime holds a group's acks back a few milliseconds for
        the others under way and queues them at once (``GroupOptions.ack_linger_s``). The future
        fails as :meth:`ack` does."""
        return relay(self._acks.submit_nowait(_Ack(_receipt_params(delivery))), _nothing, _unavailable)

    async def touch(self, delivery: Delivery, *, visibility_s: float) -> None:
        params = {**_receipt_params(delivery), "b_visible": self._clock() + max(0, round(visibility_s * 1000))}
        await self._store(self.db.run_write(_execute, _TOUCH, params))

    async def nack(self, delivery: Delivery, *, delay_s: float, reason: str = "") -> None:
        now = self._clock()
        params = {
            **_receipt_params(delivery),
            "b_now": now,
            "b_visible": now + max(0, round(delay_s * 1000)),
            "b_error": reason[:LAST_ERROR_MAX_CHARS] or None,
            "b_dead_reason": (reason or FAILED_REASON)[:LAST_ERROR_MAX_CHARS],
        }
        if await self._store(self.db.run_write(_nack, params)) and delay_s <= 0:
            self._wake(delivery.topic)

    # ------------------------------------------------------------------ dead letters and stats

    async def dead_letters(self, group: str, *, limit: int = 100) -> Sequence[DeadLetter]:
        rows = await self._store(self.db.run_read(_all, _DEAD_LETTERS, {"b_group": group, "b_limit": limit}))
        return [
            DeadLetter(
                group=group,
                topic=r.topic,
                message_id=str(r.message_id),
                key=r.msg_key,
                tag=r.tag,
                body=bytes(r.body),
                headers=json.loads(r.headers),
                delivery_count=r.delivery_count,
                dead_at_ms=r.dead_at_ms,
                reason=r.last_error or "",
            )
            for r in rows
        ]

    async def replay_dead_letter(self, group: str, message_id: str) -> bool:
        if not _canonical_id(message_id):  # the ids it lists; anything else names no message ("01", "²")
            return False
        params = {"b_group": group, "b_id": int(message_id), "b_now": self._clock()}
        replayed = await self._store(self.db.run_write(_execute, _REPLAY, params)) == 1
        if replayed:
            self._wake()
        return replayed

    async def group_stats(self, topic: str, group: str) -> GroupStats:
        row = await self._store(self.db.run_long_read(_one, _STATS, {"b_group": group, "b_now": self._clock()}))
        lag, in_flight, dead = row
        return GroupStats(topic=topic, group=group, lag=int(lag), in_flight=int(in_flight), dead_letters=int(dead))

    # ------------------------------------------------------------------ retention

    async def purge(self, before_ms: int, limit: int) -> int:
        """Delete at most ``limit`` rows the retention lets go, oldest first; the number deleted.

        In order: dead letters that died before ``before_ms``; unacknowledged
        deliveries not due or handed out since ``before_ms`` (a stopped group's
        expired backlog: logged); then messages no group needs any more (every
        group acknowledged them, or their rows expired) published before
        ``before_ms``. The maintenance role calls it with ``now - retention``.
        """
        if limit < 1:
            raise ValueError("limit must be at least 1")
        sqlite = self.db.is_sqlite
        deliveries = _SQLITE_PURGE_DELIVERIES if sqlite else _MYSQL_PURGE_DELIVERIES
        messages = _SQLITE_PURGE_MESSAGES if sqlite else _MYSQL_PURGE_MESSAGES
        deleted = 0
        for statement, state in ((deliveries, _DEAD), (deliveries, _READY), (messages, None)):
            missing = limit - deleted
            if missing <= 0:
                break
            params: dict[str, Any] = {"b_before": before_ms, "b_limit": missing}
            if state is not None:
                params["b_state"] = state
            n = await self._store(self.db.run_long_write(_execute, statement, params))
            if n and state == _READY:
                _log.warning("broker_backlog_expired", deliveries=n, before_ms=before_ms)
            deleted += n
        return deleted

    # ------------------------------------------------------------------ lifecycle

    async def ping(self) -> None:
        self._check_open()
        await self._store(self.db.run_read(_one, _PING, {}))

    async def close(self) -> None:
        """Stop: waiting fetches return what they have (nothing). The database stays open."""
        self._closed = True
        self._wake()

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerUnavailable("embedded broker is closed")

    def _wake(self, topic: str | None = None) -> None:
        """Wake the fetches waiting on ``topic`` (all of them: None)."""
        groups = self._waiters.values() if topic is None else [self._waiters.get(topic, set())]
        for waiters in groups:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def _store(self, call: Awaitable[T], timeout_s: float | None = None) -> T:
        """The database call, with "did not answer" as :class:`BrokerUnavailable`."""
        try:
            if timeout_s is None:  # most calls (claims, reads, acks): no Timeout object for nothing
                return await call
            async with asyncio.timeout(timeout_s):
                return await call
        except TimeoutError as exc:
            raise BrokerUnavailable(f"embedded broker: no answer {within(timeout_s)}") from exc
        except StoreUnavailable as exc:
            raise _unavailable(exc) from exc


def _nothing(_: object) -> None:
    return None


def _unavailable(exc: BaseException) -> BaseException:
    """A store failure as the broker port says it; anything else as it is."""
    if isinstance(exc, StoreUnavailable):
        unavailable = BrokerUnavailable(f"embedded broker: {exc}")
        unavailable.__cause__ = exc
        return unavailable
    return exc


async def open_embedded_broker(
    db: Database, config: EmbeddedBrokerConfig, *, clock: Callable[[], int] = wall_clock_ms
) -> EmbeddedBroker:
    """The embedded broker on the service's (migrated) database, per ``broker.embedded``; it answers."""
    broker = EmbeddedBroker(db, config=config, clock=clock)
    await broker.ping()
    return broker


# --------------------------------------------------------------------------- checks


def _check_name(what: str, value: str) -> None:
    if not value or len(value) > NAME_MAX_CHARS or not value.isascii():
        raise BrokerError(f"{what} must be 1 to {NAME_MAX_CHARS} ASCII characters: {value!r}")


def _check_label(what: str, value: str) -> None:
    if len(value) > LABEL_MAX_CHARS:
        raise BrokerError(f"{what} must be at most {LABEL_MAX_CHARS} characters")


def _receipt_params(delivery: Delivery) -> dict[str, Any]:
    if not isinstance(delivery.receipt, str) or not delivery.message_id.isdigit():
        raise BrokerError("not a delivery of the embedded broker")
    return {"b_group": delivery.group, "b_id": int(delivery.message_id), "b_receipt": delivery.receipt}


# --------------------------------------------------------------------------- transaction units
# Plain synchronous functions of a Connection, run by Database.run_write / run_read.


@dataclass(frozen=True, slots=True)
class _Publish:
    """A message to store: its row, and when its deliveries become visible."""

    values: dict[str, Any]
    visible_at_ms: int


@dataclass(frozen=True, slots=True)
class _Ack:
    receipt: dict[str, Any]  # b_group, b_id, b_receipt


@dataclass(frozen=True, slots=True)
class _Claim:
    topic: str
    params: dict[str, Any]  # b_group, b_now, b_until, b_receipt, b_limit


_Write = _Publish | _Ack | _Claim


def _write_all(conn: Connection, writes: list[_Write]) -> list[Any]:
    """A shared transaction's writes, in queue order: each run of publishes (or acks) together,
    each claim on its own after everything queued before it (it sees those messages and acks).
    A claim refused by its checks (an unknown group: nothing written yet) fails alone."""
    results: list[Any] = []
    start = 0
    while start < len(writes):
        kind = type(writes[start])
        end = start + 1
        if kind is not _Claim:
            while end < len(writes) and type(writes[end]) is kind:
                end += 1
        run = writes[start:end]
        if kind is _Publish:
            results.extend(_publish_all(conn, [(w.values, w.visible_at_ms) for w in run if isinstance(w, _Publish)]))
        elif kind is _Ack:
            results.extend(_ack_all(conn, [w.receipt for w in run if isinstance(w, _Ack)]))
        else:
            claim = run[0]
            assert isinstance(claim, _Claim)
            try:  # claims are queued on SQLite only (MySQL/MariaDB: each its own transaction)
                results.append(_claim_sqlite(conn, claim.topic, claim.params))
            except BrokerError as exc:
                results.append(Failed(exc))
        start = end
    return results


def _publish_all(conn: Connection, messages: list[tuple[dict[str, Any], int]]) -> list[tuple[int, bool]]:
    """Store each message unless its key is retained (then: the retained one's id), then the fan-out
    of every stored one in one executemany."""
    results: list[tuple[int, bool]] = []
    fan_out: list[dict[str, Any]] = []
    for values, visible_at_ms in messages:
        inserted = conn.execute(_INSERT_MESSAGE, values)
        if inserted.rowcount == 1:
            message_id = int(inserted.lastrowid)
            fan_out.append({"b_id": message_id, "b_topic": values["topic"], "b_visible": visible_at_ms})
            results.append((message_id, True))
        else:  # a retained key: nothing stored, the first message's id
            key = {"b_topic": values["topic"], "b_key": values["msg_key"]}
            results.append((int(conn.execute(_MESSAGE_ID, key).scalar_one()), False))
    if fan_out:
        conn.execute(_FAN_OUT, fan_out)
    return results


def _ack_all(conn: Connection, receipts: list[dict[str, Any]]) -> list[None]:
    conn.execute(_ACK, receipts)  # one executemany; a stale receipt deletes nothing, and nobody asks
    return [None] * len(receipts)


_MAX_ID: Final = 2**63 - 1


def _canonical_id(message_id: str) -> bool:
    """Whether ``message_id`` is a message id as this broker writes it: decimal ASCII digits, no
    leading zero, within the id column's range."""
    return (
        message_id.isascii()
        and message_id.isdigit()
        and str(int(message_id)) == message_id
        and int(message_id) <= _MAX_ID
    )


def _declare(conn: Connection, topic: str, group: str, max_deliveries: int, now_ms: int) -> None:
    row = {"group_name": group, "topic": topic, "max_deliveries": max_deliveries, "created_at_ms": now_ms}
    if conn.execute(_INSERT_GROUP, row).rowcount == 1:
        conn.execute(_BACKFILL, {"b_group": group, "b_topic": topic})
        return
    existing = conn.execute(_GROUP, {"b_group": group}).one()
    if existing.topic != topic:
        raise BrokerError(f"group {group!r} consumes topic {existing.topic!r}, not {topic!r}")
    if existing.max_deliveries != max_deliveries:
        conn.execute(_SET_MAX_DELIVERIES, {"b_group": group, "b_max": max_deliveries})


def _next_due(conn: Connection, topic: str, group: str) -> int | None:
    found = _known_group(group, topic, conn.execute(_NEXT_DUE, {"b_group": group}).first())
    return None if found[1] is None else int(found[1])


def _known_group(group: str, topic: str, found: Any) -> Any:
    """The group's row; BrokerError unless it exists and consumes ``topic``."""
    if found is None:
        raise BrokerError(f"unknown consumer group {group!r} (declare it first)")
    if found.topic != topic:
        raise BrokerError(f"group {group!r} consumes topic {found.topic!r}, not {topic!r}")
    return found


def _group_max(conn: Connection, topic: str, group: str) -> int:
    found = _known_group(group, topic, conn.execute(_GROUP, {"b_group": group}).first())
    return int(found.max_deliveries)


def _claim_sqlite(conn: Connection, topic: str, params: dict[str, Any]) -> tuple[list[Delivery], int]:
    rows = conn.execute(SQLITE_CLAIM, {**params, "b_max": _group_max(conn, topic, params["b_group"])}).all()
    handed_out = {r.message_id: r.delivery_count for r in rows if r.state == _READY}
    return _deliveries(conn, params, handed_out), len(rows) - len(handed_out)


def _claim_mysql(conn: Connection, topic: str, params: dict[str, Any]) -> tuple[list[Delivery], int]:
    max_deliveries = _group_max(conn, topic, params["b_group"])
    rows = conn.execute(MYSQL_CLAIM, params).all()
    buried = [r.message_id for r in rows if r.delivery_count >= max_deliveries]
    handed_out = {r.message_id: r.delivery_count + 1 for r in rows if r.delivery_count < max_deliveries}
    if buried:
        conn.execute(_MYSQL_BURY, {**params, "b_ids": buried})
    if handed_out:
        conn.execute(_MYSQL_HAND_OUT, {**params, "b_ids": list(handed_out)})
    return _deliveries(conn, params, handed_out), len(buried)


def _deliveries(conn: Connection, params: dict[str, Any], counts: dict[int, int]) -> list[Delivery]:
    if not counts:
        return []
    rows = conn.execute(_MESSAGES, {"b_ids": list(counts)}).all()
    return [
        Delivery(
            topic=r.topic,
            group=params["b_group"],
            message_id=str(r.id),
            key=r.msg_key,
            tag=r.tag,
            sharding_key=r.sharding_key,
            body=bytes(r.body),
            headers=json.loads(r.headers),
            delivery_count=counts[r.id],
            published_at_ms=r.published_at_ms,
            receipt=params["b_receipt"],
        )
        for r in sorted(rows, key=lambda r: int(r.id))
    ]


def _nack(conn: Connection, params: dict[str, Any]) -> int:
    found = conn.execute(_GROUP, {"b_group": params["b_group"]}).first()
    if found is None:
        return 0
    return conn.execute(_NACK, {**params, "b_max": found.max_deliveries}).rowcount


def _execute(conn: Connection, statement: Any, params: dict[str, Any]) -> int:
    return conn.execute(statement, params).rowcount


def _all(conn: Connection, statement: Any, params: dict[str, Any]) -> Sequence[Row[Any]]:
    return conn.execute(statement, params).all()


def _one(conn: Connection, statement: Any, params: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(conn.execute(statement, params).one())
