"""OutboxAdmin on SQLite and MariaDB: stats, list filters and pagination, show, replay and repair."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

from roomservice import errors, wire
from roomservice.admin.operations import ALL_STATUSES, OutboxAdmin, OutboxFilter
from roomservice.domain import events as e
from roomservice.store import tables as t
from roomservice.store.database import Database

T0 = 1_780_000_000_000
MIN = 60_000
HOUR = 60 * MIN


class Clock:
    def __init__(self, now_ms: int = T0) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


def gift_event(event_id: str, *, app: str = "demo", room: str = "r1", version: int = 3) -> e.Event:
    return e.Event(
        event_id=event_id,
        app_code=app,
        room_id=room,
        room_version=version,
        occurred_at_ms=T0 - HOUR,
        payload=e.RoomGiftSent(
            sender_id="alice", receiver_id="bob", gift_id="rose", count=2, unit_price=10, total_value=20
        ),
    )


def join_event(event_id: str, *, app: str = "demo", room: str = "r1", version: int = 1) -> e.Event:
    return e.Event(
        event_id=event_id,
        app_code=app,
        room_id=room,
        room_version=version,
        occurred_at_ms=T0 - HOUR,
        payload=e.RoomUserJoined(user_id="bob", role="member"),
    )


def outbox_row(
    event: e.Event,
    *,
    status: str = "pending",
    created_at_ms: int = T0,
    retry_count: int = 0,
    last_error: str | None = None,
    targets_done: str = "",
    next_retry_at_ms: int | None = None,
    lock_until_ms: int | None = None,
    lock_owner: str | None = None,
    payload: bytes | None = None,
) -> dict[str, Any]:
    """A room_outbox row as the write path and the worker leave it, with a real protobuf payload."""
    due = {"retryable": next_retry_at_ms, "delivering": lock_until_ms}.get(status) or created_at_ms
    return {
        "event_id": event.event_id,
        "app_code": event.app_code,
        "room_id": event.room_id,
        "room_version": event.room_version,
        "event_type": event.type,
        "payload": wire.encode_event(event) if payload is None else payload,
        "status": status,
        "retry_count": retry_count,
        "replay_count": 0,
        "next_retry_at_ms": next_retry_at_ms,
        "lock_until_ms": lock_until_ms,
        "lock_owner": lock_owner,
        "last_error": last_error,
        "targets_done": targets_done,
        "due_at_ms": due,
        "created_at_ms": created_at_ms,
        "updated_at_ms": created_at_ms,
        "delivered_at_ms": created_at_ms + 5 if status in ("delivered", "published") else None,
    }


async def insert_rows(db: Database, rows: list[dict[str, Any]]) -> None:
    async with db.write() as conn:
        await conn.execute(sa.insert(t.room_outbox), rows)


def sample_rows() -> list[dict[str, Any]]:
    """One row per interesting case (no 'delivering' row: its count must show as 0)."""
    return [
        outbox_row(join_event("p-old"), created_at_ms=T0 - 10 * MIN),
        outbox_row(join_event("p-new", room="r2"), created_at_ms=T0 - MIN),
        outbox_row(
            gift_event("r-1"),
            status="retryable",
            created_at_ms=T0 - 30 * MIN,
            retry_count=2,
            next_retry_at_ms=T0 + 5_000,
            last_error="Timeout talking to IM",
        ),
        outbox_row(gift_event("d-1", room="r2"), status="delivered", created_at_ms=T0 - 3 * HOUR),
        outbox_row(
            gift_event("f-1"),
            status="failed",
            created_at_ms=T0 - 2 * HOUR,
            retry_count=10,
            last_error="IM: HTTP 500 Internal Server Error",
            targets_done="activity",
        ),
        outbox_row(
            join_event("f-2", app="other", room="r2"),
            status="failed",
            created_at_ms=T0 - 5 * MIN,
            retry_count=1,
            last_error="permanent: quota 100% used",
        ),
        outbox_row(gift_event("legacy-1"), status="published", created_at_ms=T0 - 5 * HOUR),
    ]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def admin(database: Database, clock: Clock) -> OutboxAdmin:
    return OutboxAdmin(database, clock=clock)


async def row_of(db: Database, event_id: str) -> Any:
    async with db.read() as conn:
        return (await conn.execute(sa.select(t.room_outbox).where(t.room_outbox.c.event_id == event_id))).one()


async def audit_of(db: Database, event_id: str) -> list[Any]:
    async with db.read() as conn:
        result = await conn.execute(
            sa.select(t.room_outbox_audit)
            .where(t.room_outbox_audit.c.event_id == event_id)
            .order_by(t.room_outbox_audit.c.id)
        )
        return list(result.all())


def ids(rows: list[Any]) -> list[str]:
    return [r.event_id for r in rows]


# --------------------------------------------------------------------------- stats


async def test_stats_on_an_empty_outbox(admin: OutboxAdmin) -> None:
    stats = await admin.stats()
    assert stats.counts == {s: 0 for s in ALL_STATUSES}
    assert stats.total == 0
    assert stats.oldest_pending_age_ms is None
    assert stats.oldest_retryable_age_ms is None


async def test_stats_counts_every_status_and_the_oldest_ages(admin: OutboxAdmin, database: Database) -> None:
    await insert_rows(database, sample_rows())
    stats = await admin.stats()
    assert stats.counts == {
        "pending": 2,
        "delivering": 0,
        "delivered": 1,
        "retryable": 1,
        "failed": 2,
        "published": 1,
    }
    assert list(stats.counts) == list(ALL_STATUSES)
    assert stats.total == 7
    assert stats.oldest_pending_age_ms == 10 * MIN
    assert stats.oldest_retryable_age_ms == 30 * MIN
    body = stats.to_dict()
    assert body["legacy_statuses"] == ["published"]
    assert body["counts"]["published"] == 1


# --------------------------------------------------------------------------- list


async def test_list_without_filter_returns_every_row_by_id(admin: OutboxAdmin, database: Database) -> None:
    await insert_rows(database, sample_rows())
    rows = await admin.list(OutboxFilter())
    assert ids(rows) == ["p-old", "p-new", "r-1", "d-1", "f-1", "f-2", "legacy-1"]
    assert [r.id for r in rows] == sorted(r.id for r in rows)
    f1 = rows[4]
    assert f1.status == "failed"
    assert f1.retry_count == 10
    assert f1.targets_done == ("activity",)
    assert f1.age_ms == 2 * HOUR
    assert f1.event_type == "RoomGiftSent"


@pytest.mark.parametrize(
    ("flt", "expected"),
    [
        (OutboxFilter(statuses=("failed",)), ["f-1", "f-2"]),
        (OutboxFilter(statuses=("pending", "retryable")), ["p-old", "p-new", "r-1"]),
        (OutboxFilter(statuses=("published",)), ["legacy-1"]),
        (OutboxFilter(event_type="RoomUserJoined"), ["p-old", "p-new", "f-2"]),
        (OutboxFilter(app_code="other"), ["f-2"]),
        (OutboxFilter(room_id="r2"), ["p-new", "d-1", "f-2"]),
        (OutboxFilter(older_than_ms=HOUR), ["d-1", "f-1", "legacy-1"]),
        (OutboxFilter(newer_than_ms=10 * MIN), ["p-old", "p-new", "f-2"]),
        (OutboxFilter(older_than_ms=5 * MIN, newer_than_ms=30 * MIN), ["p-old", "r-1", "f-2"]),
        (OutboxFilter(error_contains="im: http 500"), ["f-1"]),  # case-insensitive
        (OutboxFilter(error_contains="TIMEOUT"), ["r-1"]),
        (OutboxFilter(error_contains="100%"), ["f-2"]),  # LIKE wildcards are literal
        (OutboxFilter(error_contains="_"), []),
        (OutboxFilter(statuses=("failed",), event_type="RoomGiftSent", room_id="r1"), ["f-1"]),
        (OutboxFilter(statuses=("failed",), app_code="demo", error_contains="permanent"), []),
        (OutboxFilter(statuses=("failed", "retryable"), older_than_ms=20 * MIN, error_contains="i"), ["r-1", "f-1"]),
    ],
)
async def test_list_filters(admin: OutboxAdmin, database: Database, flt: OutboxFilter, expected: list[str]) -> None:
    await insert_rows(database, sample_rows())
    assert ids(await admin.list(flt)) == expected


async def test_list_pages_by_id(admin: OutboxAdmin, database: Database) -> None:
    await insert_rows(database, sample_rows())
    seen: list[str] = []
    after: int | None = None
    pages = 0
    while True:
        page = await admin.list(OutboxFilter(), limit=3, after_id=after)
        if not page:
            break
        pages += 1
        seen += ids(page)
        after = page[-1].id
    assert pages == 3
    assert seen == ["p-old", "p-new", "r-1", "d-1", "f-1", "f-2", "legacy-1"]
    failed_page = await admin.list(OutboxFilter(statuses=("failed",)), limit=1)
    assert ids(failed_page) == ["f-1"]
    assert ids(await admin.list(OutboxFilter(statuses=("failed",)), limit=1, after_id=failed_page[0].id)) == ["f-2"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"filter": OutboxFilter(statuses=("dead",))}, "unknown status 'dead'"),
        ({"filter": OutboxFilter(older_than_ms=-1)}, "older_than_ms must not be negative"),
        ({"filter": OutboxFilter(older_than_ms=HOUR, newer_than_ms=MIN)}, "no row can match"),
        ({"filter": OutboxFilter(error_contains="")}, "error text"),
        ({"filter": OutboxFilter(), "limit": 0}, "limit must be 1..1000"),
        ({"filter": OutboxFilter(), "limit": 1001}, "limit must be 1..1000"),
    ],
)
async def test_list_rejects_bad_filters(admin: OutboxAdmin, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(errors.InvalidArgument, match=message):
        await admin.list(**kwargs)


async def test_unknown_status_message_names_the_valid_words() -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        OutboxFilter(statuses=("failed", "oops")).validated()
    assert "pending, delivering, delivered, retryable, failed, published" in info.value.message


# --------------------------------------------------------------------------- show


async def test_show_every_column_decoded_event_and_audit(admin: OutboxAdmin, database: Database) -> None:
    await insert_rows(database, sample_rows())
    detail = await admin.show("f-1")
    assert detail.row.event_id == "f-1"
    assert detail.row.status == "failed"
    assert detail.row.last_error == "IM: HTTP 500 Internal Server Error"
    assert detail.row.targets_done == ("activity",)
    assert detail.payload == wire.encode_event(gift_event("f-1"))
    assert detail.event == gift_event("f-1").to_dict()
    assert detail.event["type"] == "RoomGiftSent"
    assert detail.event["payload"]["total_value"] == 20
    assert detail.audit == []
    body = detail.to_dict()
    for column in t.room_outbox.c:
        if column.name != "payload":
            assert column.name in body
    assert body["payload_size"] == len(detail.payload)

    await admin.replay(["f-1"], actor="ops")
    after = await admin.show("f-1")
    assert [(a.action, a.actor) for a in after.audit] == [("replay", "ops")]


async def test_show_unknown_and_undecodable(admin: OutboxAdmin, database: Database) -> None:
    with pytest.raises(errors.NotFound, match="no outbox row with event_id nope"):
        await admin.show("nope")
    await insert_rows(database, [outbox_row(join_event("poison"), status="failed", payload=b"\xff\x00garbage")])
    detail = await admin.show("poison")
    assert detail.event is None
    assert detail.decode_error


# --------------------------------------------------------------------------- replay


async def test_replay_keeps_event_id_resets_retries_and_audits(
    admin: OutboxAdmin, database: Database, clock: Clock
) -> None:
    await insert_rows(database, sample_rows())
    clock.now_ms = T0 + 1234
    report = await admin.replay(["f-1"], actor="alice")
    assert report.replayed == 1
    assert report.outcomes[0].result == "replayed"
    assert report.outcomes[0].event_id == "f-1"

    row = await row_of(database, "f-1")
    assert row.status == "pending"
    assert row.retry_count == 0
    assert row.replay_count == 1
    assert row.next_retry_at_ms is None
    assert row.lock_owner is None and row.lock_until_ms is None
    assert row.last_error is None
    assert row.targets_done == "activity"  # a target that already succeeded is not re-sent
    assert row.due_at_ms == T0 + 1234
    assert row.updated_at_ms == T0 + 1234
    assert row.created_at_ms == T0 - 2 * HOUR
    assert row.payload == wire.encode_event(gift_event("f-1"))

    (audit,) = await audit_of(database, "f-1")
    assert audit.action == "replay"
    assert audit.actor == "alice"
    assert audit.created_at_ms == T0 + 1234
    detail = json.loads(audit.detail)
    assert detail["previous_retry_count"] == 10
    assert detail["previous_last_error"] == "IM: HTTP 500 Internal Server Error"
    assert detail["replay_count"] == 1


async def test_replay_reports_not_found_and_not_failed_without_raising(admin: OutboxAdmin, database: Database) -> None:
    await insert_rows(database, sample_rows())
    report = await admin.replay(["nope", "f-1", "d-1", "f-2", "f-1", "p-old"], actor="ops")
    assert [(o.event_id, o.result, o.status) for o in report.outcomes] == [
        ("nope", "not_found", None),
        ("f-1", "replayed", "failed"),
        ("d-1", "not_failed", "delivered"),
        ("f-2", "replayed", "failed"),
        ("p-old", "not_failed", "pending"),
    ]
    assert (report.replayed, report.not_found, report.not_failed) == (2, 1, 2)
    assert "no outbox row with event_id nope" in report.outcomes[0].message
    assert "d-1 is delivered, not failed" in report.outcomes[2].message
    assert (await row_of(database, "d-1")).status == "delivered"
    assert await audit_of(database, "d-1") == []

    again = await admin.replay(["f-1"], actor="ops")  # now pending: not replayed twice
    assert [(o.result, o.status) for o in again.outcomes] == [("not_failed", "pending")]
    assert (await row_of(database, "f-1")).replay_count == 1


async def test_replay_counts_each_replay(admin: OutboxAdmin, database: Database) -> None:
    await insert_rows(database, [outbox_row(gift_event("f-1"), status="failed", retry_count=10)])
    await admin.replay(["f-1"], actor="ops")
    async with database.write() as conn:  # the worker fails it again
        await conn.execute(
            sa.update(t.room_outbox)
            .where(t.room_outbox.c.event_id == "f-1")
            .values(status="failed", retry_count=10, last_error="again")
        )
    await admin.replay(["f-1"], actor="ops")
    row = await row_of(database, "f-1")
    assert (row.status, row.retry_count, row.replay_count) == ("pending", 0, 2)
    audits = await audit_of(database, "f-1")
    assert [json.loads(a.detail)["previous_last_error"] for a in audits] == [None, "again"]


async def test_replay_as_repair_writes_a_new_event(admin: OutboxAdmin, database: Database, clock: Clock) -> None:
    await insert_rows(database, sample_rows())
    clock.now_ms = T0 + 99
    report = await admin.replay(["f-1"], actor="ops", as_repair=True)
    (outcome,) = report.outcomes
    assert outcome.result == "replayed"
    new_id = outcome.new_event_id
    assert new_id and new_id != "f-1" and len(new_id) == 32
    assert outcome.targets == ("broker", "im")  # f-1 had reached activity: not sent there again

    original = await row_of(database, "f-1")
    assert original.status == "failed"
    assert original.retry_count == 10
    assert original.replay_count == 0
    assert original.last_error == "IM: HTTP 500 Internal Server Error"

    repair = await row_of(database, new_id)
    assert repair.status == "pending"
    assert (repair.app_code, repair.room_id, repair.room_version, repair.event_type) == (
        "demo",
        "r1",
        3,
        "RoomGiftSent",
    )
    # the worker sends required - done: the target that succeeded for f-1 starts as done
    assert (repair.retry_count, repair.replay_count, repair.targets_done) == (0, 0, "activity")
    assert repair.due_at_ms == repair.created_at_ms == T0 + 99
    assert repair.id > original.id
    decoded = wire.decode_event(repair.payload)
    assert decoded.event_id == new_id
    assert decoded.repair_of == "f-1"
    assert decoded.payload == gift_event("f-1").payload
    assert decoded.occurred_at_ms == gift_event("f-1").occurred_at_ms

    (orig_audit,) = await audit_of(database, "f-1")
    assert orig_audit.action == "repair"
    assert json.loads(orig_audit.detail)["repair_event_id"] == new_id
    assert json.loads(orig_audit.detail)["targets"] == ["broker", "im"]
    (new_audit,) = await audit_of(database, new_id)
    assert new_audit.action == "repair_of"
    assert json.loads(new_audit.detail)["original_event_id"] == "f-1"
    assert json.loads(new_audit.detail)["targets_named"] is False

    shown = await admin.show(new_id)
    assert shown.event is not None and shown.event["event_id"] == new_id
    assert shown.event["repair_of"] == "f-1"
    assert [a.action for a in shown.audit] == ["repair_of"]


async def test_repair_of_an_undecodable_payload_is_reported(admin: OutboxAdmin, database: Database) -> None:
    await insert_rows(database, [outbox_row(join_event("poison"), status="failed", payload=b"\xff\x00garbage")])
    report = await admin.replay(["poison"], actor="ops", as_repair=True)
    assert [o.result for o in report.outcomes] == ["undecodable"]
    assert (await row_of(database, "poison")).status == "failed"
    plain = await admin.replay(["poison"], actor="ops")  # a plain replay does not need to decode
    assert [o.result for o in plain.outcomes] == ["replayed"]


async def test_repair_to_named_targets_marks_every_other_target_done(admin: OutboxAdmin, database: Database) -> None:
    await insert_rows(database, sample_rows())  # f-1: a gift that reached activity, failed at im
    report = await admin.replay(["f-1"], actor="ops", as_repair=True, targets=["im,activity"])
    (both,) = report.outcomes
    assert (both.result, both.targets) == ("replayed", ("activity", "im"))
    assert report.to_dict()["targets"] == ["activity", "im"]
    assert both.new_event_id is not None
    assert (await row_of(database, both.new_event_id)).targets_done == "broker"
    (audit,) = await audit_of(database, both.new_event_id)
    assert (json.loads(audit.detail)["targets"], json.loads(audit.detail)["targets_named"]) == (
        ["activity", "im"],
        True,
    )

    await database.run_write(_fail_again, "f-1")
    (only,) = (await admin.replay(["f-1"], actor="ops", as_repair=True, targets=["activity"])).outcomes
    assert only.new_event_id is not None and only.targets == ("activity",)
    assert (await row_of(database, only.new_event_id)).targets_done == "broker,im"


def _fail_again(conn: sa.Connection, event_id: str) -> None:
    conn.execute(sa.update(t.room_outbox).where(t.room_outbox.c.event_id == event_id).values(status="failed"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"as_repair": True, "targets": ["im", "sms"]}, "unknown target 'sms'; expected one of im, activity, broker"),
        ({"as_repair": True, "targets": ["IM"]}, "unknown target 'IM'"),
        ({"as_repair": True, "targets": ["notice"]}, "unknown target 'notice'"),
        ({"as_repair": True, "targets": [" , "]}, "targets must name at least one"),
        ({"as_repair": True, "targets": []}, "targets must name at least one"),
        ({"targets": ["im"]}, "targets apply to a repair only"),
    ],
)
async def test_repair_targets_are_validated_before_anything_is_written(
    admin: OutboxAdmin, database: Database, kwargs: dict[str, Any], message: str
) -> None:
    await insert_rows(database, sample_rows())
    with pytest.raises(errors.InvalidArgument, match=message):
        await admin.replay(["f-1"], actor="ops", **kwargs)
    with pytest.raises(errors.InvalidArgument, match=message):
        await admin.replay_matching(OutboxFilter(), actor="ops", **kwargs)
    assert (await admin.stats()).total == len(sample_rows())
    assert (await row_of(database, "f-1")).status == "failed"


async def test_a_repair_with_no_target_left_writes_nothing(admin: OutboxAdmin, database: Database) -> None:
    done = outbox_row(gift_event("all-done"), status="failed", targets_done="activity,broker,im")
    await insert_rows(database, [*sample_rows(), done])
    report = await admin.replay(["all-done", "f-1"], actor="ops", as_repair=True, targets=["treasure_wakeup"])
    assert [o.result for o in report.outcomes] == ["no_targets", "no_targets"]
    assert "RoomGiftSent has none of the targets named (treasure_wakeup" in report.outcomes[1].message
    (default,) = (await admin.replay(["all-done"], actor="ops", as_repair=True)).outcomes
    assert default.result == "no_targets"
    assert "every target of RoomGiftSent (activity, broker, im) succeeded" in default.message
    assert report.to_dict()["no_targets"] == 2
    assert (await admin.stats()).total == len(sample_rows()) + 1
    assert await audit_of(database, "all-done") == []


async def test_a_repair_of_a_repair_still_names_the_first_event(admin: OutboxAdmin, database: Database) -> None:
    await insert_rows(database, sample_rows())
    (first,) = (await admin.replay(["f-1"], actor="ops", as_repair=True)).outcomes
    assert first.new_event_id is not None
    await database.run_write(_fail_again, first.new_event_id)
    (second,) = (await admin.replay([first.new_event_id], actor="ops", as_repair=True)).outcomes
    assert second.new_event_id is not None
    decoded = wire.decode_event((await row_of(database, second.new_event_id)).payload)
    assert (decoded.event_id, decoded.repair_of) == (second.new_event_id, "f-1")
    # the first repair's pre-marked targets carry over: still not sent to activity
    assert (await row_of(database, second.new_event_id)).targets_done == "activity"


async def test_bulk_repair_to_named_targets(admin: OutboxAdmin, database: Database) -> None:
    await insert_rows(database, sample_rows())
    report = await admin.replay_matching(OutboxFilter(), actor="ops", as_repair=True, targets=["activity"])
    assert sorted((o.event_id, o.targets) for o in report.outcomes) == [
        ("f-1", ("activity",)),
        ("f-2", ("activity",)),
    ]
    for o in report.outcomes:
        assert o.new_event_id is not None
        assert (await row_of(database, o.new_event_id)).targets_done == "broker,im"


async def test_a_bulk_repair_run_again_writes_no_second_repair(admin: OutboxAdmin, database: Database) -> None:
    """A repair by filter run again (or resumed after a batch failed) leaves the originals it repaired
    before: each original gets one repair event, not one a run (found by review). Named ids are repaired
    again, as asked."""
    await insert_rows(database, sample_rows())
    first = await admin.replay_matching(OutboxFilter(), actor="ops", as_repair=True)
    assert sorted(o.event_id for o in first.outcomes if o.result == "replayed") == ["f-1", "f-2"]
    again = await admin.replay_matching(OutboxFilter(), actor="ops", as_repair=True)
    assert sorted((o.event_id, o.result) for o in again.outcomes) == [
        ("f-1", "already_repaired"),
        ("f-2", "already_repaired"),
    ]
    assert again.to_dict()["already_repaired"] == 2
    for original in ("f-1", "f-2"):  # one repair event each
        assert [a.action for a in await audit_of(database, original)].count("repair") == 1
    (named,) = (await admin.replay(["f-1"], actor="ops", as_repair=True)).outcomes
    assert named.result == "replayed" and named.new_event_id is not None


async def test_bulk_replay_in_batches_with_progress(admin: OutboxAdmin, database: Database) -> None:
    failed = [
        outbox_row(gift_event(f"bulk-{i}", room="r9"), status="failed", created_at_ms=T0 - HOUR, last_error="boom")
        for i in range(7)
    ]
    await insert_rows(database, [*sample_rows(), *failed])
    calls: list[tuple[int, int]] = []
    report = await admin.replay_matching(
        OutboxFilter(room_id="r9"), actor="ops", batch_size=3, progress=lambda d, n: calls.append((d, n))
    )
    assert calls == [(0, 7), (3, 7), (6, 7), (7, 7)]
    assert report.replayed == 7
    assert sorted(o.event_id for o in report.outcomes) == sorted(r["event_id"] for r in failed)
    for r in failed:
        row = await row_of(database, r["event_id"])
        assert (row.status, row.retry_count, row.replay_count) == ("pending", 0, 1)
        assert [a.action for a in await audit_of(database, r["event_id"])] == ["replay"]
    # rows outside the filter are untouched
    assert (await row_of(database, "f-1")).status == "failed"
    assert (await row_of(database, "f-2")).status == "failed"


async def test_bulk_replay_filters_and_forces_failed(admin: OutboxAdmin, database: Database) -> None:
    await insert_rows(database, sample_rows())
    report = await admin.replay_matching(OutboxFilter(error_contains="http 500"), actor="ops")
    assert [o.event_id for o in report.outcomes] == ["f-1"]
    assert (await row_of(database, "r-1")).status == "retryable"
    report = await admin.replay_matching(OutboxFilter(statuses=("failed",), older_than_ms=MIN), actor="ops")
    assert [o.event_id for o in report.outcomes] == ["f-2"]
    with pytest.raises(errors.InvalidArgument, match="failed"):
        await admin.replay_matching(OutboxFilter(statuses=("pending",)), actor="ops")


async def test_bulk_replay_with_nothing_to_do(admin: OutboxAdmin, database: Database) -> None:
    await insert_rows(database, sample_rows())
    calls: list[tuple[int, int]] = []
    report = await admin.replay_matching(
        OutboxFilter(room_id="nowhere"), actor="ops", progress=lambda d, n: calls.append((d, n))
    )
    assert report.outcomes == []
    assert calls == [(0, 0)]


async def test_bulk_repair_terminates_and_leaves_originals_failed(admin: OutboxAdmin, database: Database) -> None:
    failed = [outbox_row(join_event(f"bf-{i}", room="r7"), status="failed") for i in range(5)]
    await insert_rows(database, failed)
    calls: list[tuple[int, int]] = []
    report = await admin.replay_matching(
        OutboxFilter(), actor="ops", as_repair=True, batch_size=2, progress=lambda d, n: calls.append((d, n))
    )
    assert calls[-1] == (5, 5)
    assert report.replayed == 5
    new_ids = [o.new_event_id for o in report.outcomes]
    assert all(new_ids) and len(set(new_ids)) == 5
    stats = await admin.stats()
    assert (stats.counts["failed"], stats.counts["pending"]) == (5, 5)
    for new_id in new_ids:
        assert new_id is not None
        assert wire.decode_event((await row_of(database, new_id)).payload).event_id == new_id


async def test_on_requeued_hook(database: Database) -> None:
    woken: list[int] = []
    admin = OutboxAdmin(database, clock=Clock(), on_requeued=lambda: woken.append(1))
    await insert_rows(database, sample_rows())
    await admin.replay(["d-1", "nope"], actor="ops")
    assert woken == []
    await admin.replay(["f-1"], actor="ops")
    assert woken == [1]


async def test_replay_validates_arguments(admin: OutboxAdmin) -> None:
    with pytest.raises(errors.InvalidArgument, match="actor"):
        await admin.replay(["x"], actor="  ")
    with pytest.raises(errors.InvalidArgument, match="batch_size"):
        await admin.replay_matching(OutboxFilter(), actor="ops", batch_size=0)
    assert (await admin.replay([], actor="ops")).outcomes == []
