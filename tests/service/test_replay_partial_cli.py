"""What the CLI and the console show when a replay stops after some batches committed.

The outage itself is real in tests/integration/test_replay_interrupted.py; here the
second batch's write is refused as the store refuses it, to check what each face shows.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import typer
from tests.service.test_outbox_admin import Clock, gift_event, insert_rows, outbox_row

from roomservice.admin import cli
from roomservice.admin.operations import OutboxAdmin, OutboxFilter, ReplayInterrupted
from roomservice.console.jobs import Jobs
from roomservice.store.database import Database
from roomservice.store.port import StoreUnavailable


class SecondBatchFails:
    def __init__(self, db: Database) -> None:
        self._db, self.writes = db, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)

    async def run_long_write(self, *args: Any, **kwargs: Any) -> Any:
        self.writes += 1
        if self.writes == 2:
            raise StoreUnavailable("database unavailable")
        return await self._db.run_long_write(*args, **kwargs)


@pytest.fixture
async def cut_admin(database: Database) -> OutboxAdmin:
    await insert_rows(database, [outbox_row(gift_event(f"dead-{i}"), status="failed") for i in range(5)])
    admin = OutboxAdmin(database, clock=Clock())
    admin.db = SecondBatchFails(database)  # type: ignore[assignment]
    return admin


async def test_the_cli_prints_the_committed_batches_then_fails(
    cut_admin: OutboxAdmin, capsys: pytest.CaptureFixture[str]
) -> None:
    report, stopped = await cli._partial(cut_admin.replay_matching(OutboxFilter(), actor="ops", batch_size=2))
    assert isinstance(stopped, ReplayInterrupted)
    with pytest.raises(typer.Exit) as exit_:
        cli._finish_replay(report, as_json=True, bulk=True, stopped=stopped)
    assert exit_.value.exit_code == 1
    out, err = capsys.readouterr()
    body = json.loads(out)
    assert body["replayed"] == 2
    assert [r["event_id"] for r in body["results"]] == ["dead-0", "dead-1"]
    assert body["error"]["code"] == "unavailable"
    assert "replay stopped after 2 of 5 row(s)" in body["error"]["message"]
    assert "replay stopped after 2 of 5 row(s)" in err

    with pytest.raises(typer.Exit):
        cli._finish_replay(report, as_json=False, bulk=True, stopped=stopped)
    out, err = capsys.readouterr()
    assert "replayed 2 of 2 failed row(s)" in out
    assert "run the same replay again to go on" in err


async def test_a_console_job_cut_short_keeps_the_summary_of_the_committed_batches(cut_admin: OutboxAdmin) -> None:
    jobs = Jobs()
    job = jobs.start(
        "replay", "ops", lambda progress: cut_admin.replay(
            [f"dead-{i}" for i in range(5)], actor="ops", batch_size=2, progress=progress
        )
    )
    try:
        for task in list(jobs._tasks):  # the job's own task: wait for it to end
            await task
    finally:
        await jobs.aclose()
    assert job.state == "failed"
    assert job.error is not None and "replay stopped after 2 of 5 row(s)" in job.error
    assert job.summary["replayed"] == 2
    assert (job.done, job.total) == (2, 5)
