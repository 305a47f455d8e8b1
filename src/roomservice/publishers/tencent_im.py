"""The Tencent IM publisher (target ``im``): room events become group messages and group control.

Per SPEC §3/§5:

* RoomCreated -> EnsureGroup: import the owner's account, create the group; "exists and
  you own it" (10025) is success. "Taken by someone else" (10021) is success too when
  ``get_group_info`` shows the group has the type and owner we asked for (Tencent words
  10025 for the *operator*, our app admin, not the owner, so it may answer 10021 for a
  group we made, e.g. CreateRoom's before the RoomCreated row's); otherwise permanent.
* every other event -> one group custom message (TIMCustomElem) whose ``Data`` is JSON
  ``{event_id, type, room_version, payload}`` and whose ``Random`` derives from event_id
  (both the original's for a repair event: :func:`~roomservice.domain.events.dedup_id`),
  so Tencent's 5-minute duplicate window absorbs quick re-sends. Tencent refuses for good a
  body over 12 KB (:data:`~roomservice.integrations.tencent_im.client.MSG_BODY_MAX_BYTES`):
  a RoomTreasureOpened whose recipients do not all fit lists as many as fit and says so
  (:func:`message_data`); any other event that does not fit fails permanently
  (:class:`MessageTooLarge`) before any of its steps calls IM;
* RoomUserKicked -> membership control by group type first (delete the member; on an
  AVChatRoom ban them, falling back to muting them for the ban length);
* RoomClosed -> the message, then destroy the group ("group not found" counts as done).

A step that finds no group (10010/10015) for a room that is not closed means the group is
missing — Tencent dismissed it, or an IM without memory (the embedded sandbox before it
kept its state) forgot it — so the publisher ensures the group again, as for RoomCreated,
with the owner and title of the room's ``room_meta`` row, and retries the step once. A
group we destroyed ourselves (RoomClosed's ``destroy`` step recorded) or a room that is
closed in ``room_meta`` is not brought back: the step counts as done. A room with no
``room_meta`` row (nothing to take the owner from) stays retryable, as before.

Every step that succeeded is recorded in ``im_sent_event`` (event_id, step), so a retry —
even after the 5-minute window — re-sends only the steps that did not happen.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import sqlalchemy as sa

from roomservice.coalesce import Coalesced, HeldBack
from roomservice.domain import events as e
from roomservice.domain.routing import Target
from roomservice.domain.state import CLOSED
from roomservice.integrations.tencent_im import errors as im_errors
from roomservice.integrations.tencent_im.client import (
    MSG_BODY_MAX_BYTES,
    TencentImClient,
    account_id_for,
    group_id_for,
    random_for,
)
from roomservice.observability.logging import get_logger
from roomservice.publishers.port import PermanentError, RetryableError
from roomservice.store import tables as t
from roomservice.store.database import Database

_log = get_logger("roomservice.im")

GROUP, MEMBER, MESSAGE, DESTROY = "group", "member", "message", "destroy"
RECORD_LINGER_S = 0.02  # the longest a record waits for those of the other publishes under way
AVCHATROOM = "AVChatRoom"


@dataclass(frozen=True, slots=True)
class RoomOfGroup:
    """What ensuring a room's group again needs, from ``room_meta``."""

    owner_id: str
    title: str
    status: str


class SentSteps:
    """Our own record of IM steps done per event (Tencent dedupes for 5 minutes only), and
    the room a missing group is re-created for."""

    def __init__(self, db: Database, *, clock: Callable[[], int], record_linger_s: float = RECORD_LINGER_S) -> None:
        self._db = db
        self.db = db  # the store the record lives in (the IM bridge reads the room's outbox rows there)
        self._clock = clock
        self._insert = db.insert_ignoring_duplicates(t.im_sent_event)
        # records that arrive together share one write transaction; while other publishes are under
        # way a record waits a moment for theirs (sends come one by one, at the IM rate limit)
        self._records: Coalesced[dict[str, object], None] = Coalesced(db, self._insert_all)
        self._under_way = 0
        self._record = HeldBack(self._records.submit, linger_s=record_linger_s, expected=lambda: self._under_way)
        # the look-ups that arrive together (the IM bridge's deliveries of one fetch) share one read
        self._reads: Coalesced[str, set[str]] = Coalesced(db, _done_all, read=True)
        self._destroyed = (
            sa.select(t.im_sent_event.c.event_id)
            .where(t.im_sent_event.c.group_id == sa.bindparam("group_id"), t.im_sent_event.c.operation == DESTROY)
            .limit(1)
        )
        meta = t.room_meta.c
        self._room = sa.select(meta.owner_id, meta.title, meta.status).where(
            meta.app_code == sa.bindparam("app_code"), meta.room_id == sa.bindparam("room_id")
        )

    def _insert_all(self, conn: sa.Connection, rows: list[dict[str, object]]) -> list[None]:
        for row in rows:
            conn.execute(self._insert, row)
        return [None] * len(rows)

    async def room(self, app_code: str, room_id: str) -> RoomOfGroup | None:
        """The room's owner, title and status; ``None``: no such room in the store."""
        rows = await self._db.run_read(_rows, self._room, {"app_code": app_code, "room_id": room_id})
        return RoomOfGroup(str(rows[0].owner_id), str(rows[0].title), str(rows[0].status)) if rows else None

    async def done(self, event_id: str) -> set[str]:
        return await self._reads.submit(event_id)

    async def destroyed(self, group_id: str) -> bool:
        """Did we destroy this group (its room closed)?"""
        return bool(await self._db.run_read(_rows, self._destroyed, {"group_id": group_id}))

    async def closed(self, app_code: str, room_id: str, group_id: str) -> bool:
        """Is the room closed — we destroyed its group, or ``room_meta`` says so? Either way its group must
        not come back. ``room_meta`` keeps a closed room for good (room ids are never reused), so this
        holds after the destroy record has gone with the other dedup records (consumers.dedup_retention)."""
        if await self.destroyed(group_id):
            return True
        room = await self.room(app_code, room_id)
        return room is not None and room.status == CLOSED

    async def record(self, event_id: str, group_id: str, step: str) -> None:
        row = {"event_id": event_id, "group_id": group_id, "operation": step, "sent_at_ms": self._clock()}
        await self._record(row)

    @contextlib.contextmanager
    def under_way(self) -> Iterator[None]:
        """Around a publish that may record steps: others' records wait a moment for its own."""
        self._under_way += 1
        try:
            yield
        finally:
            self._under_way -= 1


def _rows(conn: sa.Connection, statement: sa.Executable, params: dict[str, object]) -> list[sa.Row[Any]]:
    return list(conn.execute(statement, params).all())


_SENT_STEPS: Final = sa.select(t.im_sent_event.c.event_id, t.im_sent_event.c.operation).where(
    t.im_sent_event.c.event_id.in_(sa.bindparam("event_ids", expanding=True))
)


def _done_all(conn: sa.Connection, event_ids: list[str]) -> list[set[str]]:
    """The steps recorded for each of ``event_ids`` (one statement; a repeated id gets the same)."""
    done: dict[str, set[str]] = {event_id: set() for event_id in event_ids}
    for event_id, operation in conn.execute(_SENT_STEPS, {"event_ids": list(done)}):
        done[event_id].add(operation)
    return [set(done[event_id]) for event_id in event_ids]


class MessageTooLarge(PermanentError):
    """The event's message would be over the 12 KB Tencent takes: it is not sent (Tencent would refuse it for good)."""


def message_data(event: e.Event) -> str:
    """The custom message's ``Data``: what clients need to reconcile with the room view.

    ``event_id`` is the event's :func:`~roomservice.domain.events.dedup_id`: a repair names
    its original, so a client that got the original and, past Tencent's duplicate window,
    its repair sees one event twice (same Data) and keeps it once.

    The body Tencent takes is at most ``MSG_BODY_MAX_BYTES`` (12 KB; ours is ``Data`` alone, as
    UTF-8, Desc and Ext being empty). A RoomTreasureOpened over that (up to 200 recipients of up
    to 64 characters) lists the first recipients that fit, and its payload says so:
    ``recipients_truncated`` true and ``recipient_count`` the number of recipients of the event
    (both only then). Any other event over it raises :class:`MessageTooLarge`."""
    payload = event.payload.to_dict()
    data = _data(event, payload)
    if _size(data) <= MSG_BODY_MAX_BYTES:
        return data
    if isinstance(event.payload, e.RoomTreasureOpened):
        truncated = _treasure_data_that_fits(event, payload)
        if truncated is not None:
            return truncated
    raise MessageTooLarge(
        f"{event.type} event {event.event_id}: its IM message would be {_size(data)} bytes, over the "
        f"{MSG_BODY_MAX_BYTES} bytes Tencent takes for a message body; not sent"
    )


def _data(event: e.Event, payload: dict[str, Any]) -> str:
    return json.dumps(
        {
            "event_id": e.dedup_id(event),
            "type": event.type,
            "room_version": event.room_version,
            "payload": payload,
        },
        separators=(",", ":"),
        ensure_ascii=False,
    )


def _size(data: str) -> int:
    return len(data.encode("utf-8"))


def _treasure_data_that_fits(event: e.Event, payload: dict[str, Any]) -> str | None:
    """``Data`` with the most recipients (the first ones) that fits, marked as truncated; ``None``:
    not even one without any fits. (The size grows with the number kept: a binary search.)"""
    recipients = list(payload["recipients"])

    def keeping(count: int) -> str:
        kept = {**payload, "recipients": recipients[:count], "recipients_truncated": True}
        return _data(event, {**kept, "recipient_count": len(recipients)})

    best: str | None = None
    low, high = 0, len(recipients) - 1  # all of them did not fit even without the two fields
    while low <= high:
        middle = (low + high) // 2
        data = keeping(middle)
        if _size(data) <= MSG_BODY_MAX_BYTES:
            best, low = data, middle + 1
        else:
            high = middle - 1
    return best


def steps_of(event_type: str) -> frozenset[str]:
    """The steps an event of this type takes, the last one recorded last."""
    if event_type == "RoomCreated":
        return frozenset({GROUP})
    if event_type == "RoomUserKicked":
        return frozenset({MEMBER, MESSAGE})
    if event_type == "RoomClosed":
        return frozenset({MESSAGE, DESTROY})
    return frozenset({MESSAGE})


def message_step_of(event_type: str) -> str:
    """The step that says a room's client-visible effect of this event happened (its message;
    RoomCreated, which has none, its group)."""
    return GROUP if event_type == "RoomCreated" else MESSAGE


class TencentImPublisher:
    name = Target.IM.value

    def __init__(self, client: TencentImClient, steps: SentSteps, *, group_type: str = AVCHATROOM) -> None:
        self.client = client
        self.steps = steps
        self.group_type = group_type

    def group_of(self, app_code: str, room_id: str) -> str:
        return group_id_for(app_code, room_id, group_type=self.group_type)

    async def steps_done(self, event: e.Event) -> set[str]:
        """The IM steps of ``event`` (of its original, for a repair) our record shows as done."""
        return await self.steps.done(e.dedup_id(event))

    async def already_sent(self, event: e.Event, done: set[str] | None = None) -> bool:
        """Has every IM step of ``event`` been recorded as done (so publishing it would send nothing)?
        A RoomCreated of a room closed since counts as done: it never brings the group back.
        ``done``: :meth:`steps_done` read by the caller a moment ago (None: read it here)."""
        if done is None:
            done = await self.steps_done(event)
        if isinstance(event.payload, e.RoomCreated):
            group = self.group_of(event.app_code, event.room_id)
            return GROUP in done or await self.steps.closed(event.app_code, event.room_id, group)
        return steps_of(event.type) <= done

    async def publish(
        self, event: e.Event, *, payload: bytes, deadline: float, done: set[str] | None = None
    ) -> None:
        """Do the IM steps of ``event`` our record does not show; ``done``: that record, read by the
        caller a moment ago (None: read it here)."""
        try:
            with self.steps.under_way():
                await self._publish(event, deadline, done)
        except im_errors.ImError as exc:
            if exc.retryable:
                raise RetryableError(str(exc)) from exc
            raise PermanentError(str(exc)) from exc

    async def _publish(self, event: e.Event, deadline: float, done: set[str] | None) -> None:
        group = self.group_of(event.app_code, event.room_id)
        sent_id = e.dedup_id(event)  # a repair event shares its original's sent record
        if done is None:
            done = await self.steps.done(sent_id)
        p = event.payload
        if isinstance(p, e.RoomCreated):
            # a late retry after the room closed must not bring the group back (ids are never reused)
            if GROUP not in done and not await self.steps.closed(event.app_code, event.room_id, group):
                await self._ensure_group(group, p.owner_id, p.title, deadline)
                await self.steps.record(sent_id, group, GROUP)
            return
        # the message's Data first: one too large for IM fails (MessageTooLarge) before any step calls IM
        data = message_data(event) if MESSAGE not in done else ""
        if isinstance(p, e.RoomUserKicked) and MEMBER not in done:
            target_id, ban_seconds = p.target_id, p.ban_seconds
            await self._in_group(
                event, group, lambda: self._remove_member(group, target_id, ban_seconds, deadline), deadline
            )
            await self.steps.record(sent_id, group, MEMBER)
        if MESSAGE not in done:
            await self._in_group(event, group, lambda: self._send_message(group, event, data, deadline), deadline)
            await self.steps.record(sent_id, group, MESSAGE)
        if isinstance(p, e.RoomClosed) and DESTROY not in done:
            await self._destroy(group, deadline)
            await self.steps.record(sent_id, group, DESTROY)

    # ------------------------------------------------------------------ steps

    async def ensure_group(
        self, *, app_code: str, room_id: str, owner_id: str, title: str, deadline: float | None = None
    ) -> None:
        """CreateRoom's synchronous group creation (the RoomCreated row is its safety net)."""
        await self._ensure_group(self.group_of(app_code, room_id), owner_id, title, deadline)

    async def _ensure_group(self, group: str, owner_id: str, title: str, deadline: float | None) -> None:
        owner = account_id_for(owner_id)
        await self.client.account_import(owner, deadline=deadline)  # Owner_Account must exist
        try:
            await self.client.create_group(group, owner, title, self.group_type, deadline=deadline)
        except im_errors.ImPermanentError as exc:
            if exc.code == im_errors.GROUP_ID_USED_BY_YOU:  # 10025: exists and ours
                return
            if exc.code != im_errors.GROUP_ID_TAKEN or not await self._group_is_ours(group, owner, deadline):
                raise  # someone else's group (10021), or another refusal: permanent

    async def _group_is_ours(self, group: str, owner: str, deadline: float | None) -> bool:
        """After a 10021 ("used by someone else"): is the group the one we asked for (our type, our owner)?
        Tencent words 10025 for the operator (our app admin), not the owner, so it may answer 10021 for a
        group we made ourselves (CreateRoom's, then the RoomCreated row's)."""
        infos = await self.client.get_group_info([group], base_fields=("Type", "Owner_Account"), deadline=deadline)
        info = next((i for i in infos if i.group_id == group), None)
        ours = info is not None and info.found and info.type == self.group_type and info.owner_account == owner
        if ours:
            _log.info("im_group_id_taken_by_our_own_group", group_id=group, code=im_errors.GROUP_ID_TAKEN)
        return ours

    async def _send_message(self, group: str, event: e.Event, data: str, deadline: float) -> None:
        # the Random of the original event (dedup_id), as its sent record: a repair sent inside Tencent's
        # duplicate window after the original went out unrecorded is dropped by Tencent, not shown twice
        await self.client.send_group_msg(group, data, random=random_for(e.dedup_id(event)), deadline=deadline)

    async def _remove_member(self, group: str, user_id: str, ban_seconds: int, deadline: float) -> None:
        member = account_id_for(user_id)
        try:
            if self.group_type != AVCHATROOM:
                await self.client.delete_group_member(group, [member], deadline=deadline)
                return
            try:
                await self.client.ban_group_member(group, [member], ban_seconds, deadline=deadline)
            except im_errors.ImPermanentError as exc:
                if exc.code != im_errors.FEATURE_NOT_ENABLED:
                    raise
                # banning needs a higher package on some apps: mute them for the ban instead
                _log.info("im_ban_fell_back_to_mute", group_id=group, code=exc.code)
                await self.client.forbid_send_msg(group, [member], ban_seconds, deadline=deadline)
        except im_errors.ImPermanentError as exc:
            if exc.code == im_errors.ACCOUNT_NOT_FOUND:  # never in IM: nothing to remove
                return
            raise

    async def _in_group(self, event: e.Event, group: str, step: Callable[[], Awaitable[None]], deadline: float) -> None:
        """Run a step that needs the group; if the group is missing, ensure it again and
        run the step once more (unless the room is closed: then the step is moot)."""
        try:
            await step()
            return
        except im_errors.ImPermanentError as exc:
            if exc.code not in im_errors.GROUP_NOT_FOUND_CODES:
                raise
            missing = exc
        if not await self._ensure_missing_group(event, group, missing, deadline):
            return
        try:
            await step()
        except im_errors.ImPermanentError as exc:
            if exc.code not in im_errors.GROUP_NOT_FOUND_CODES:
                raise
            # created a moment ago and still not found: IM is not consistent yet; try again later
            raise im_errors.ImRetryableError(str(exc), code=exc.code, info=exc.info, command=exc.command) from exc

    async def _ensure_missing_group(self, event: e.Event, group: str, exc: im_errors.ImError, deadline: float) -> bool:
        """A step found no group. False: the room is closed (we destroyed the group, or
        ``room_meta`` says closed), the step is done. True: the group was ensured again.
        A room the store does not know stays retryable (nothing to take the owner from)."""
        if await self.steps.destroyed(group):
            _log.info("im_step_for_closed_room_dropped", group_id=group, command=exc.command)
            return False
        room = await self.steps.room(event.app_code, event.room_id)
        if room is None:
            raise im_errors.ImRetryableError(str(exc), code=exc.code, info=exc.info, command=exc.command) from exc
        if room.status == CLOSED:
            _log.info("im_step_for_closed_room_dropped", group_id=group, command=exc.command)
            return False
        _log.warning("im_group_missing_ensuring_again", group_id=group, command=exc.command, code=exc.code)
        await self._ensure_group(group, room.owner_id, room.title, deadline)
        return True

    async def _destroy(self, group: str, deadline: float) -> None:
        try:
            await self.client.destroy_group(group, deadline=deadline)
        except im_errors.ImPermanentError as exc:
            if exc.code not in im_errors.GROUP_NOT_FOUND_CODES:  # already gone counts as done
                raise
