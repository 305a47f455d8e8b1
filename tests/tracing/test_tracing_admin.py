"""Operators find a row's trace: the admin detail names its trace id; a repair's delivery joins the same trace."""

from __future__ import annotations

import httpx
import sqlalchemy as sa
from tests.console.conftest import console, console_runtime, http, logged_in
from tests.service.test_outbox_admin import T0, gift_event, insert_rows, outbox_row
from tests.tracing.conftest import new_traceparent

from roomservice.admin.operations import OutboxAdmin
from roomservice.bootstrap import Process
from roomservice.store import tables as t
from roomservice.store.database import Database

__all__ = ["console", "console_runtime", "http"]  # the console's fixtures


async def test_the_detail_names_the_trace_and_a_repair_keeps_it(sqlite_database: Database) -> None:
    traceparent, trace_id, _ = new_traceparent()
    row = {**outbox_row(gift_event("f-1"), status="failed", targets_done="activity"), "trace_context": traceparent}
    untraced_row = {**outbox_row(gift_event("f-2"), status="failed"), "trace_context": None}
    await insert_rows(sqlite_database, [row, untraced_row])
    admin = OutboxAdmin(sqlite_database, clock=lambda: T0)

    detail = await admin.show("f-1")
    assert detail.row.trace_context == traceparent and detail.row.trace_id == trace_id
    assert detail.to_dict()["trace_context"] == traceparent
    untraced = await admin.show("f-2")
    assert untraced.row.trace_context is None and untraced.row.trace_id is None

    await admin.replay(["f-1"], actor="ops", as_repair=True)
    async with sqlite_database.read() as conn:
        contexts = (await conn.execute(sa.select(t.room_outbox.c.event_id, t.room_outbox.c.trace_context))).all()
    repairs = [context for event_id, context in contexts if event_id not in ("f-1", "f-2")]
    assert repairs == [traceparent]


async def test_the_console_event_page_shows_the_trace_id(console_runtime: Process, http: httpx.AsyncClient) -> None:
    traceparent, trace_id, _ = new_traceparent()
    row = {**outbox_row(gift_event("t-1"), status="failed"), "trace_context": traceparent}
    await insert_rows(console_runtime.db, [row])
    await logged_in(http)
    page = await http.get("/console/outbox/t-1")
    assert page.status_code == 200
    assert f'<code id="row-trace">{trace_id}</code>' in page.text
