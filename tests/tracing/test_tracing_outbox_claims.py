"""Every claim path of the SQL outbox repository hands the worker the row's stored trace context."""

from __future__ import annotations

import sqlalchemy as sa
from tests.service.test_outbox_admin import T0, gift_event, outbox_row
from tests.tracing.conftest import new_traceparent

from roomservice.outbox.repository import Delivered
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.store import tables as t
from roomservice.store.database import Database


async def test_claim_due_and_finish_and_claim_carry_the_trace_context(database: Database) -> None:
    first, second = new_traceparent()[0], new_traceparent()[0]
    rows = [
        {**outbox_row(gift_event("a-1", version=1)), "trace_context": first},
        {**outbox_row(gift_event("a-2", version=2)), "trace_context": None},
    ]
    async with database.write() as conn:
        await conn.execute(sa.insert(t.room_outbox), rows)
    repository = SqlOutboxRepository(database)

    claimed = await repository.claim_due(owner="w", now_ms=T0, lock_ms=30_000, limit=1)
    assert [(r.event_id, r.trace_context) for r in claimed] == [("a-1", first)]
    async with database.write() as conn:
        row = {**outbox_row(gift_event("a-3", version=3)), "trace_context": second}
        await conn.execute(sa.insert(t.room_outbox), [row])
    _, next_claim = await repository.finish_and_claim(
        owner="w", now_ms=T0, delivered=[Delivered(claimed[0].id, "broker")], retries=[], lock_ms=30_000, limit=10
    )
    assert sorted((r.event_id, r.trace_context) for r in next_claim) == [("a-2", None), ("a-3", second)]
