"""A bulk replay whose database goes away between batches, for real: MariaDB behind a TCP proxy.

The batches that committed before the outage are reported (:class:`ReplayInterrupted`
carries their report, over HTTP beside the 503 error), and the same replay run again
after the outage goes on where it stopped: every dead letter is replayed exactly once.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from tests.integration.test_database_deadlines import D, through
from tests.service.test_outbox_admin import gift_event, insert_rows, outbox_row
from tests.tcp_proxy import TcpProxy

from roomservice.admin.operations import OutboxAdmin, OutboxFilter, ReplayInterrupted
from roomservice.clock import wall_clock_ms
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.store.migrate import upgrade
from roomservice.store.port import StoreUnavailable

ROWS = 7
BATCH = 3


async def statuses(db: Database) -> dict[str, str]:
    async with db.read() as conn:
        rows = (await conn.execute(sa.select(t.room_outbox.c.event_id, t.room_outbox.c.status))).all()
    return {r.event_id: r.status for r in rows}


async def replay_counts(db: Database) -> dict[str, int]:
    async with db.read() as conn:
        rows = (await conn.execute(sa.select(t.room_outbox.c.event_id, t.room_outbox.c.replay_count))).all()
    return {r.event_id: int(r.replay_count) for r in rows}


@pytest.mark.parametrize("by", ["filter", "ids"])
async def test_a_replay_cut_between_batches_reports_the_committed_ones_and_resumes(
    proxy: TcpProxy, fresh_mariadb_url: str, by: str
) -> None:
    direct = Database.from_url(fresh_mariadb_url, pool_size=1, max_overflow=0)
    cut = Database.from_url(through(proxy, fresh_mariadb_url), pool_size=1, max_overflow=0, timeout_s=D)
    try:
        await upgrade(direct)
        ids = [f"dead-{i}" for i in range(ROWS)]
        await insert_rows(direct, [outbox_row(gift_event(i), status="failed", last_error="boom") for i in ids])

        def cut_after_first_batch(done: int, total: int) -> None:
            if done > 0:
                proxy.blackhole()  # the next batch never gets an answer

        admin = OutboxAdmin(cut, clock=wall_clock_ms)
        replay = (
            admin.replay_matching(OutboxFilter(), actor="ops", batch_size=BATCH, progress=cut_after_first_batch)
            if by == "filter"
            else admin.replay(ids, actor="ops", batch_size=BATCH, progress=cut_after_first_batch)
        )
        with pytest.raises(ReplayInterrupted) as stopped:
            await replay
        report = stopped.value.report
        assert [o.result for o in report.outcomes] == ["replayed"] * BATCH
        done = {o.event_id for o in report.outcomes}
        assert f"after {BATCH} of {ROWS} row(s)" in stopped.value.message
        body: dict[str, Any] = stopped.value.to_body()
        assert body["error"]["code"] == "unavailable"
        assert body["report"]["replayed"] == BATCH
        assert {r["event_id"] for r in body["report"]["results"]} == done

        now = await statuses(direct)
        assert {i for i, s in now.items() if s == "pending"} == done  # the committed batch, and nothing else
        assert {i for i, s in now.items() if s == "failed"} == set(ids) - done

        proxy.forward()
        again = OutboxAdmin(direct, clock=wall_clock_ms)
        if by == "filter":
            rest = await again.replay_matching(OutboxFilter(), actor="ops", batch_size=BATCH)
            assert {o.event_id for o in rest.outcomes} == set(ids) - done
        else:
            rest = await again.replay(ids, actor="ops", batch_size=BATCH)
            assert {o.event_id for o in rest.outcomes if o.result == "not_failed"} == done
        assert rest.replayed == ROWS - BATCH
        assert set((await statuses(direct)).values()) == {"pending"}
        assert set((await replay_counts(direct)).values()) == {1}  # each dead letter replayed exactly once
    finally:
        await cut.dispose()
        await direct.dispose()


async def test_a_replay_whose_first_batch_fails_is_plainly_unavailable(
    proxy: TcpProxy, fresh_mariadb_url: str
) -> None:
    """Nothing committed: no partial report to give, the store's own error."""
    direct = Database.from_url(fresh_mariadb_url, pool_size=1, max_overflow=0)
    cut = Database.from_url(through(proxy, fresh_mariadb_url), pool_size=1, max_overflow=0, timeout_s=D)
    try:
        await upgrade(direct)
        await insert_rows(direct, [outbox_row(gift_event("dead-0"), status="failed")])
        proxy.blackhole()
        with pytest.raises(StoreUnavailable) as failed:
            await OutboxAdmin(cut, clock=wall_clock_ms).replay(["dead-0"], actor="ops")
        assert not isinstance(failed.value, ReplayInterrupted)
        assert (await statuses(direct)) == {"dead-0": "failed"}
    finally:
        proxy.forward()
        await cut.dispose()
        await direct.dispose()
