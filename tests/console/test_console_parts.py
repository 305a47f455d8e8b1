"""The console's parts alone: the consumer dead-letter admin (audited replay), the chart's series, sessions."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa

from roomservice import errors
from roomservice.admin import dead_letters as dead_letters_module
from roomservice.admin.dead_letters import DeadLetterAdmin
from roomservice.admin.operations import OutboxAdmin, ReplayReport
from roomservice.bootstrap.broker import GroupSpec
from roomservice.brokers.fake import FakeBroker
from roomservice.brokers.port import OutgoingMessage
from roomservice.console.jobs import KEEP, Jobs
from roomservice.console.series import DeliverySeries, Point, Sample, chart_svg
from roomservice.console.session import Sessions, valid_operator
from roomservice.store.database import Database
from roomservice.store.tables import room_outbox_audit

TOPIC, GROUP = "hyapp_room_outbox", "g-bridge"


async def bury(broker: FakeBroker, *keys: str) -> None:
    await broker.declare_group(TOPIC, GROUP, max_deliveries=1)
    for key in keys:
        await broker.publish(OutgoingMessage(topic=TOPIC, body=b"x", key=key, tag="RoomUserJoined"), timeout_s=1)
    deliveries = await broker.fetch(TOPIC, GROUP, max_messages=10, wait_s=0.1, visibility_s=5)
    for delivery in deliveries:
        await broker.nack(delivery, delay_s=0, reason="IM down")


async def test_dead_letter_replay_goes_to_the_group_and_is_audited(sqlite_database: Database) -> None:
    broker = FakeBroker()
    await bury(broker, "ev-1", "ev-2", "ev-3")
    admin = DeadLetterAdmin(broker, [GroupSpec(GROUP, TOPIC, 1)], audit=OutboxAdmin(sqlite_database, clock=lambda: 5))
    [report] = await admin.reports()
    assert report.stats is not None and report.stats.dead_letters == 3
    letters = await admin.dead_letters(GROUP)
    first = letters[0].message_id
    result = await admin.replay(GROUP, [first, "no-such-id"], actor="console:ann")
    assert result.replayed == (first,) and result.not_dead_letters == ("no-such-id",)
    assert len(await admin.dead_letters(GROUP)) == 2
    rest = await admin.replay(GROUP, None, actor="console:ann")
    assert len(rest.replayed) == 2 and not await admin.dead_letters(GROUP)
    async with sqlite_database.read() as conn:
        rows = (await conn.execute(sa.select(room_outbox_audit).order_by(room_outbox_audit.c.id))).all()
    assert sorted(r.event_id for r in rows) == ["ev-1", "ev-2", "ev-3"]
    assert {(r.action, r.actor) for r in rows} == {("consumer_replay", "console:ann")}
    assert GROUP in (rows[0].detail or "")
    with pytest.raises(errors.NotFound, match="unknown consumer group"):
        await admin.replay("other", None, actor="x")


async def test_dead_letters_are_audited_as_they_are_replayed_and_a_failed_audit_names_them(
    sqlite_database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay is for good: audited a chunk at a time as it goes (a crash leaves at most a chunk without
    its rows), and an audit that cannot be written says which letters were replayed without one."""
    monkeypatch.setattr(dead_letters_module, "AUDIT_CHUNK", 2)
    broker = FakeBroker()
    await bury(broker, "ev-1", "ev-2", "ev-3")
    audit = OutboxAdmin(sqlite_database, clock=lambda: 5)
    written: list[int] = []
    record = audit.record_audit

    async def record_then_fail(entries: list[tuple[str, dict[str, object]]], **kw: object) -> None:
        if written:  # the second chunk's rows cannot be written
            raise errors.Unavailable("database unavailable")
        written.append(len(entries))
        await record(entries, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(audit, "record_audit", record_then_fail)
    admin = DeadLetterAdmin(broker, [GroupSpec(GROUP, TOPIC, 1)], audit=audit)
    replayed_unaudited = r"3 dead letter\(s\) of .* were replayed, but the audit of the last 1"
    with pytest.raises(errors.Unavailable, match=replayed_unaudited):
        await admin.replay(GROUP, None, actor="console:ann")
    assert written == [2] and not await admin.dead_letters(GROUP)
    async with sqlite_database.read() as conn:
        rows = (await conn.execute(sa.select(room_outbox_audit.c.event_id))).scalars().all()
    assert sorted(rows) == ["ev-1", "ev-2"]  # the first chunk's, written while it went


def test_series_rates_cover_the_window_and_survive_a_counter_reset() -> None:
    series = DeliverySeries(window_s=60, interval_s=10)
    series.record(Sample(0, 0, 5))
    series.record(Sample(30_000, 10, 4))  # 10 rows in half a minute
    series.record(Sample(60_000, 40, 0))
    series.record(Sample(90_000, 2, 1))  # the counter restarted
    points = series.points(now_ms=90_000)
    assert [p.at_ms for p in points] == [60_000, 90_000]  # the window keeps samples from 30 s on
    assert points[0].rate_per_min == 60.0 and points[0].backlog == 0
    assert points[1].rate_per_min == 0.0 and points[1].backlog == 1


def test_chart_draws_both_lines_or_says_there_is_nothing_yet() -> None:
    empty = chart_svg([], now_ms=0, window_ms=60_000)
    assert "no samples yet" in empty and "<polyline" not in empty
    drawn = chart_svg([Point(30_000, 12.0, 3), Point(60_000, 6.0, 7)], now_ms=60_000, window_ms=60_000)
    assert drawn.count("<polyline") == 2 and ">20<" in drawn and ">10<" in drawn  # rounded-up scales


def test_sessions_sign_expire_and_keep_operators_printable() -> None:
    now = [100.0]
    sessions = Sessions("tok", ttl_s=10, clock=lambda: now[0])
    value, session = sessions.issue("ann")
    assert sessions.read(value) == session and session.actor == "console:ann"
    assert sessions.csrf_ok(session, session.csrf_token) and not sessions.csrf_ok(session, "x")
    assert sessions.read(value.replace(".", "x.", 1)) is None
    assert Sessions("other", ttl_s=10).read(value) is None  # a new admin token ends every session
    now[0] += 10
    assert sessions.read(value) is None
    assert sessions.token_ok("tok") and not sessions.token_ok("tok ") and not Sessions("", ttl_s=1).token_ok("")
    assert valid_operator("  Zoë  ") == "Zoë"
    assert valid_operator("a\nb") is None and valid_operator("x" * 49) is None and valid_operator(" ") is None


def test_the_wheel_carries_every_template_and_static_file() -> None:
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["roomservice"]
    package = root / "src" / "roomservice"
    files = [p for d in ("templates", "static") for p in (package / "console" / d).iterdir()]
    assert len(files) >= 12
    for path in files:
        relative = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns), relative
        assert "://" not in path.read_text(), f"{relative} loads something from elsewhere: the console works offline"


async def test_a_running_job_is_kept_however_many_finish_after_it() -> None:
    """Jobs keeps the newest KEEP; a job still running is never the one to go (its page polls it)."""
    jobs, release = Jobs(), asyncio.Event()

    async def slow(_: object) -> ReplayReport:
        await release.wait()
        return ReplayReport(as_repair=False)

    async def quick(_: object) -> ReplayReport:
        return ReplayReport(as_repair=False)

    running = jobs.start("slow", "alice", slow)
    for n in range(KEEP + 5):
        jobs.start(f"quick {n}", "alice", quick)
        await asyncio.sleep(0)  # each quick one finishes before the next starts
    assert jobs.get(running.id) is running and running.state == "running"
    assert len(jobs.recent()) <= KEEP + 1
    release.set()
    await jobs.aclose()
