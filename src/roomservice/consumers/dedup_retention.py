"""Applied event ids forgotten after ``consumers.dedup_retention``, in bounded batches.

Whatever deduplicates on an event's id keeps a row for each event it applied:

* ``im_sent_event``: each IM step sent, by the direct Tencent IM publisher and
  the IM bridge;
* ``activity_processed_event``: each event the activity service applied;
* ``notice_delivery_events``: each kicked user's notice.

Without a purge each of them grows by a row an event for ever. A row older than
the retention is deleted; the same event delivered again after that is applied
again. So the retention must outlast every way an event comes back:
``consumers.dedup_retention`` is at least ``outbox_worker.delivered_retention``
and the embedded broker's ``retention`` (config checks both).

Kept whatever their age:

* the record of an event whose outbox row is still there (a dead letter, kept
  until an operator replays it: the replay is deduplicated as ever, and the IM
  bridge, closing a room, finds that event sent and does not send it again);
* a notice still ``pending``: a delivery of it may be under way.

A group's destroy record goes too: whether a room's group must not come back is
also answered by ``room_meta``, which keeps a closed room for good
(:meth:`~roomservice.publishers.tencent_im.SentSteps.closed`). A message replayed
from a broker's own dead letters later than the retention may repeat its effect
(README, the outbox worker; docs/configuration.md).

The maintenance role sweeps all three tables of its database, under its
maintenance lock named :data:`LOCK_NAME`; ``room-service activity serve`` sweeps
the activity table of its database under the database lock of that name. Two
sweeps at once only waste work: each deletes the rows it picked, by key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from sqlalchemy import ColumnElement, exists

from roomservice.config import Settings
from roomservice.consumers.notice import PENDING
from roomservice.leases.maintenance import MaintenanceLock
from roomservice.outbox.retention import Purge, RetentionSweeper
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.store.purge import OldestFirst

LOCK_NAME: Final = "roomservice_dedup_retention"

_im, _activity, _notice = t.im_sent_event.c, t.activity_processed_event.c, t.notice_delivery_events.c


def _outbox_row_gone(event_id: ColumnElement[str]) -> ColumnElement[bool]:
    """No outbox row of this event is left (none in this database, for a service on its own)."""
    return ~exists().where(t.room_outbox.c.event_id == event_id)


def activity_purges(db: Database) -> list[Purge]:
    """The activity service's record of processed events."""
    return [
        OldestFirst(
            db, t.activity_processed_event, _activity.processed_at_ms, _outbox_row_gone(_activity.event_id)
        )
    ]


def dedup_purges(db: Database) -> list[Purge]:
    """Every dedup record in ``db``: IM steps sent, activity, notices sent or failed."""
    return [
        OldestFirst(db, t.im_sent_event, _im.sent_at_ms, _outbox_row_gone(_im.event_id)),
        *activity_purges(db),
        OldestFirst(
            db,
            t.notice_delivery_events,
            _notice.updated_at_ms,
            _notice.status != PENDING,
            _outbox_row_gone(_notice.event_id),
        ),
    ]


def dedup_sweeper(
    lock: MaintenanceLock, purges: list[Purge], settings: Settings, *, clock: Callable[[], int]
) -> RetentionSweeper:
    """The sweeper of ``purges`` under :data:`LOCK_NAME`: rows older than ``consumers.dedup_retention``,
    ``outbox_worker.retention_batch_size`` a statement."""
    return RetentionSweeper(
        lock,
        purges,
        retention_ms=int(settings.consumers.dedup_retention.total_seconds() * 1000),
        batch_size=settings.outbox_worker.retention_batch_size,
        clock=clock,
        lock_name=LOCK_NAME,
    )
