"""Applied event ids forgotten after ``consumers.dedup_retention``, in bounded batches.

Whatever deduplicates on an event's id keeps a row for each event it applied:

* ``im_sent_event``: each IM step sent, by the direct Tencent IM publisher and
  the IM bridge;
* ``activity_processed_event``: each event the activity service applied;
* ``notice_delivery_events``: each kicked user's notice.

Without a purge each of them grows by a row an event for ever. A row older than
the retention is deleted; the same event delivered or replayed after that is
applied again. So the retention must outlast every way an event comes back:
``consumers.dedup_retention`` is at least ``outbox_worker.delivered_retention``
and the embedded broker's ``retention`` (config checks both). A dead letter
replayed later than that may repeat an effect that had applied before its
failure was recorded (README, the outbox worker; docs/configuration.md).

Kept whatever their age:

* a group's destroy record (``im_sent_event`` step ``destroy``): one row a closed
  room, read to answer "was this group destroyed?", so an old event of a closed
  room replayed later does not create its group again;
* a notice still ``pending``: a delivery of it may be under way.

The maintenance role sweeps all three tables of its database, under its
maintenance lock named :data:`LOCK_NAME`; ``room-service activity serve`` sweeps
the activity table of its database under the database lock of that name. Two
sweeps at once only waste work: each deletes the rows it picked, by key.
"""

from __future__ import annotations

from typing import Final

from roomservice.consumers.notice import PENDING
from roomservice.outbox.retention import Purge
from roomservice.publishers.tencent_im import DESTROY
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.store.purge import OldestFirst

LOCK_NAME: Final = "roomservice_dedup_retention"

_im, _activity, _notice = t.im_sent_event.c, t.activity_processed_event.c, t.notice_delivery_events.c


def activity_purges(db: Database) -> list[Purge]:
    """The activity service's record of processed events."""
    return [OldestFirst(db, t.activity_processed_event, _activity.processed_at_ms)]


def dedup_purges(db: Database) -> list[Purge]:
    """Every dedup record in ``db``: IM steps sent (not a destroy), activity, notices sent or failed."""
    return [
        OldestFirst(db, t.im_sent_event, _im.sent_at_ms, _im.operation != DESTROY),
        *activity_purges(db),
        OldestFirst(db, t.notice_delivery_events, _notice.updated_at_ms, _notice.status != PENDING),
    ]
