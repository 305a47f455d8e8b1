"""The admin operations check their arguments themselves: the CLI and the console reach them without the HTTP schema."""

from __future__ import annotations

import re

import pytest
from tests.service.test_outbox_admin import gift_event, insert_rows, outbox_row

from roomservice import errors
from roomservice.admin.operations import OutboxAdmin, OutboxFilter
from roomservice.bootstrap import Process
from roomservice.clock import wall_clock_ms
from roomservice.domain.limits import MAX_ID_VALUE
from roomservice.store.database import Database


async def test_list_takes_after_id_up_to_a_signed_64_bit_integer(api_runtime: Process) -> None:
    admin = OutboxAdmin(api_runtime.db, clock=wall_clock_ms)
    assert await admin.list(after_id=MAX_ID_VALUE) == []
    for after_id in (MAX_ID_VALUE + 1, 2**64, -1):
        with pytest.raises(errors.InvalidArgument, match="after_id"):  # not SQLite's OverflowError
            await admin.list(after_id=after_id)


async def test_ids_and_filters_outside_their_patterns_are_invalid_argument(database: Database) -> None:
    # ascii_bin columns: MariaDB failed the comparison with a non-ASCII literal (StoreUnavailable)
    await insert_rows(database, [outbox_row(gift_event("f-1"), status="failed", retry_count=10)])
    admin = OutboxAdmin(database, clock=wall_clock_ms)
    with pytest.raises(errors.InvalidArgument, match=re.escape("event_id: '\u00e9' is not an event id")):
        await admin.show("\u00e9")
    with pytest.raises(errors.InvalidArgument, match=re.escape("event_ids: 'f-\u00e9' is not an event id")):
        await admin.replay(["f-1", "f-\u00e9"], actor="ops")
    for flt, name in (
        (OutboxFilter(event_type="\u00e9"), "event_type"),
        (OutboxFilter(app_code="\u00e9"), "app_code"),
        (OutboxFilter(room_id="r1\u00e9"), "room_id"),
        (OutboxFilter(app_code="Demo"), "app_code"),
    ):
        with pytest.raises(errors.InvalidArgument, match=f"^{name}: '"):
            await admin.list(flt)
        with pytest.raises(errors.InvalidArgument, match=f"^{name}: '"):
            await admin.count(flt)
        with pytest.raises(errors.InvalidArgument, match=f"^{name}: '"):
            await admin.replay_matching(flt, actor="ops")
    with pytest.raises(errors.InvalidArgument, match=re.escape("--room: 'r 1' does not match")):
        OutboxFilter.parse(room_id="r 1", names={"room_id": "--room"})
    assert (await admin.show("f-1")).row.status == "failed"  # nothing was replayed
    with pytest.raises(errors.NotFound):
        await admin.show("no-such.id:1")  # a well-formed id no row has: still not found
