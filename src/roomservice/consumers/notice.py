"""The ``hyapp-notice-room-outbox`` group: a kicked user gets one private (C2C) notice.

``RoomUserKicked`` (the only type the routing table sends to ``Target.NOTICE``)
becomes one row in ``notice_delivery_events`` and one ``openim/sendmsg`` to the
kicked user's IM account. Every other type is acknowledged as ``DUPLICATE``
(nothing applied) without touching the database or IM — by its tag, before the
body is decoded, when the tag names a known type (a body of another type that
this group cannot read is not its poison); an unknown tag is decoded as below.

Per delivery:

1. decode and validate the envelope as the activity path does
   (:func:`~roomservice.activity.service.event_from_wire`; the kicked user's id too):
   a body that is no valid event raises ``ValueError`` — poison, dead-lettered after
   the limit;
2. insert the row (``pending``, attempts 0, the message's ``Data`` as ``payload``)
   unless it exists; the key is :func:`~roomservice.domain.events.dedup_id`, so a
   repair event is its original's notice;
3. a row already ``sent`` → ``DUPLICATE``: IM is not called again (our sent record
   covers what Tencent's 120-second duplicate window does not);
4. otherwise import the account (Tencent requires it), then send the row's payload
   with ``MsgRandom`` and ``MsgSeq`` derived from the event id — a re-send carries the
   same sender, MsgSeq, MsgRandom and body, so Tencent drops it as a duplicate within
   its window (the case of a crash between the send and our update);
5. success: ``sent``, ``sent_at_ms``, ``msg_key``, ``attempts + 1`` → ``APPLIED``;
   an IM error: ``attempts + 1`` and ``last_error``, and the error is raised so the
   delivery fails. A retryable one (outage, timeout, throttling, signature) leaves the
   row ``pending``: the runtime retries with backoff. A permanent one (Tencent refused
   the request) marks it ``failed`` and fails the delivery too, so it is retried up to
   the limit and then sits in the group's dead letter, replayable once the cause is
   fixed (a replay sends again: only ``sent`` stops a send).

Two deliveries of one event at the same moment (a visibility timeout that ran out
mid-send, or the event published twice) may both call IM; the identical
MsgSeq/MsgRandom/body makes Tencent keep one message, and only the first to mark the
row ``sent`` reports ``APPLIED`` (the other ``DUPLICATE``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

import sqlalchemy as sa

from roomservice.activity.service import InvalidEvent, event_from_wire
from roomservice.brokers.port import Delivery
from roomservice.consumers.runtime import Outcome
from roomservice.domain import events as e
from roomservice.domain.limits import valid_id
from roomservice.domain.routing import Target, for_others_only, targets_of
from roomservice.integrations.tencent_im import errors as im_errors
from roomservice.integrations.tencent_im.client import TencentImClient, account_id_for, random_for
from roomservice.observability.logging import get_logger
from roomservice.store.database import Database
from roomservice.store.tables import notice_delivery_events

_log = get_logger("roomservice.consumers.notice")

KICKED: Final = "kicked"
PENDING, SENT, FAILED = "pending", "sent", "failed"
MAX_ERROR_CHARS: Final = 1000

_n = notice_delivery_events
_ROW: Final = sa.select(_n.c.status, _n.c.im_account, _n.c.payload, _n.c.attempts).where(
    _n.c.event_id == sa.bindparam("event_id")
)
_SENT: Final = (
    sa.update(_n)
    .where(_n.c.event_id == sa.bindparam("key"), _n.c.status != SENT)
    .values(
        status=SENT,
        attempts=_n.c.attempts + 1,
        msg_key=sa.bindparam("msg_key"),
        sent_at_ms=sa.bindparam("now"),
        updated_at_ms=sa.bindparam("now"),
    )
)
_FAILED_ATTEMPT: Final = (
    sa.update(_n)
    .where(_n.c.event_id == sa.bindparam("key"), _n.c.status != SENT)
    .values(
        status=sa.bindparam("status"),
        attempts=_n.c.attempts + 1,
        last_error=sa.bindparam("error"),
        updated_at_ms=sa.bindparam("now"),
    )
)


def notice_data(event: e.Event) -> str:
    """The C2C custom message's ``Data``: which room removed the user, by whom, until when."""
    payload = event.payload
    assert isinstance(payload, e.RoomUserKicked)
    return json.dumps(
        {
            "kind": KICKED,
            "event_id": e.dedup_id(event),
            "type": event.type,
            "app_code": event.app_code,
            "room_id": event.room_id,
            "room_version": event.room_version,
            "occurred_at_ms": event.occurred_at_ms,
            "payload": payload.to_dict(),
        },
        separators=(",", ":"),
        ensure_ascii=False,
    )


class NoticeHandler:
    def __init__(
        self,
        db: Database,
        im: TencentImClient,
        *,
        group: str,
        topic: str,
        clock: Callable[[], int],
        sender: str = "administrator",
    ) -> None:
        """``sender``: the account the notice comes from; the admin identifier sends as itself
        (no ``From_Account``), any other account is imported once before its first notice."""
        self.db = db
        self.im = im
        self.group = group
        self.topic = topic
        self.clock = clock
        self.sender = sender
        self._from_account = None if sender == im.admin_identifier else sender
        self._sender_imported = self._from_account is None
        self._insert = db.insert_ignoring_duplicates(_n)

    async def handle(self, delivery: Delivery) -> Outcome:
        if for_others_only(delivery.tag, Target.NOTICE):
            return Outcome.DUPLICATE  # tagged with a type that has no notice: acked, the body not even decoded
        event = event_from_wire(delivery.body)  # InvalidEvent (a ValueError): poison
        payload = event.payload
        if Target.NOTICE not in targets_of(event.type) or not isinstance(payload, e.RoomUserKicked):
            return Outcome.DUPLICATE  # no notice for this type: acked, nothing applied
        if not valid_id(payload.target_id):
            raise InvalidEvent(f"invalid target_id: {payload.target_id!r}"[:200])
        key = e.dedup_id(event)
        row = await self._row(key, event, payload)
        if row["status"] == SENT:
            return Outcome.DUPLICATE
        try:
            result = await self._send(key, row["im_account"], row["payload"])
        except im_errors.ImError as exc:
            await self._record_failure(key, exc, attempts=row["attempts"] + 1, room=event.room_id)
            raise
        marked = await self.db.run_write(_count, _SENT, {"key": key, "msg_key": result.msg_key, "now": self.clock()})
        if not marked:  # a concurrent delivery of this event sent it first (IM kept one message)
            return Outcome.DUPLICATE
        _log.info("notice_sent", event_id=key, room_id=event.room_id, user_id=payload.target_id)
        return Outcome.APPLIED

    async def _row(self, key: str, event: e.Event, payload: e.RoomUserKicked) -> dict[str, Any]:
        """The notice's row, written first (pending) if this is its first delivery."""
        now = self.clock()
        values = {
            "event_id": key,
            "app_code": event.app_code,
            "room_id": event.room_id,
            "user_id": payload.target_id,
            "im_account": account_id_for(payload.target_id),
            "kind": KICKED,
            "status": PENDING,
            "attempts": 0,
            "last_error": None,
            "payload": notice_data(event),
            "msg_key": None,
            "created_at_ms": now,
            "updated_at_ms": now,
            "sent_at_ms": None,
        }
        return await self.db.run_write(_insert_and_read, self._insert, values)

    async def _send(self, key: str, account: str, data: str) -> Any:
        if not self._sender_imported:
            assert self._from_account is not None
            await self.im.account_import(self._from_account)
            self._sender_imported = True
        await self.im.account_import(account)  # To_Account must exist in IM (20003 otherwise)
        return await self.im.send_c2c_msg(
            account,
            data,
            random=random_for(key),
            msg_seq=random_for(f"notice-seq:{key}"),
            from_account=self._from_account,
        )

    async def _record_failure(self, key: str, exc: im_errors.ImError, *, attempts: int, room: str) -> None:
        status = PENDING if exc.retryable else FAILED
        error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        params = {"key": key, "status": status, "error": error, "now": self.clock()}
        await self.db.run_write(_execute, _FAILED_ATTEMPT, params)
        log = _log.info if exc.retryable else _log.warning
        log("notice_send_failed", event_id=key, room_id=room, status=status, attempts=attempts, error=error)


def _insert_and_read(conn: sa.Connection, insert: sa.Insert, values: dict[str, Any]) -> dict[str, Any]:
    conn.execute(insert, values)
    found = conn.execute(_ROW, {"event_id": values["event_id"]}).one()
    return dict(found._mapping)


def _execute(conn: sa.Connection, statement: sa.Executable, params: dict[str, Any]) -> None:
    conn.execute(statement, params)


def _count(conn: sa.Connection, statement: sa.Update, params: dict[str, Any]) -> int:
    """Rows the update matched (MySQL dialects count matched, not changed, rows)."""
    return int(conn.execute(statement, params).rowcount)
