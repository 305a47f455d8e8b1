"""The write command pipeline end to end on a real store: idempotency, wallet, fencing, recovery."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import sqlalchemy as sa
from structlog.contextvars import merge_contextvars
from structlog.testing import capture_logs
from tests.service.conftest import Clock, RuntimeFactory
from tests.service.helpers import APP, count, logged_versions, outbox_rows, run

from roomservice import errors
from roomservice.bootstrap import Process
from roomservice.domain import commands as c
from roomservice.observability.logging import get_logger
from roomservice.store import tables as t
from roomservice.store.port import StoreInconsistent
from roomservice.wallet.fake import FakeWallet
from roomservice.wallet.journal import JournalEntry
from roomservice.wallet.reconcile import Reconciler

TIMING_FIELDS = {
    "command",
    "app_code",
    "room_id",
    "command_id",
    "result",
    "version",
    "total_ms",
    "idempotency_ms",
    "lease_ms",
    "wallet_debit_ms",
    "save_mutation_ms",
    "snapshot_ms",
    "projection_ms",
    "activity_ms",
    "tencent_im_ms",
    "activity_async_outbox",
    "tencent_im_async_outbox",
}


async def open_room(rt: Process, room: str = "r1", *members: str) -> None:
    await run(rt, room, f"{room}-create", c.CreateRoom(owner_id="owner", title="Room"))
    for user in members:
        await run(rt, room, f"{room}-join-{user}", c.JoinRoom(user_id=user))


async def test_create_commits_version_one_with_outbox_row(runtime: Process) -> None:
    body = await run(runtime, "r1", "cmd-1", c.CreateRoom(owner_id="owner", title="Hi"))
    assert body["version"] == 1
    assert body["replayed"] is False
    assert [e["type"] for e in body["events"]] == ["RoomCreated"]
    rows = await outbox_rows(runtime, "r1")
    assert [(r.event_type, r.status, r.room_version) for r in rows] == [("RoomCreated", "pending", 1)]
    assert rows[0].event_id == body["events"][0]["event_id"]


async def test_same_command_id_replays_original_response(runtime: Process) -> None:
    await open_room(runtime)
    first = await run(runtime, "r1", "join-bob", c.JoinRoom(user_id="bob"))
    again = await run(runtime, "r1", "join-bob", c.JoinRoom(user_id="bob"))
    assert again == {**first, "replayed": True}
    assert len(await outbox_rows(runtime, "r1")) == 2  # RoomCreated + one RoomUserJoined


async def test_replay_survives_a_restart(runtime_factory: RuntimeFactory) -> None:
    async with runtime_factory() as rt:
        await open_room(rt)
        first = await run(rt, "r1", "join-bob", c.JoinRoom(user_id="bob"))
    async with runtime_factory() as rt:
        again = await run(rt, "r1", "join-bob", c.JoinRoom(user_id="bob"))
        assert again == {**first, "replayed": True}
        assert len(await outbox_rows(rt, "r1")) == 2


async def test_reused_command_id_with_other_payload_is_409(runtime: Process) -> None:
    await open_room(runtime)
    await run(runtime, "r1", "x", c.JoinRoom(user_id="bob"))
    with pytest.raises(errors.CommandIdReused):
        await run(runtime, "r1", "x", c.JoinRoom(user_id="carol"))
    view = await runtime.service.room(APP, "r1")
    assert [m["user_id"] for m in view["members"]] == ["owner", "bob"]


async def test_noop_is_logged_without_version_bump(runtime: Process) -> None:
    await open_room(runtime, "r1", "bob")
    body = await run(runtime, "r1", "again", c.JoinRoom(user_id="bob"))
    assert body["version"] == 2
    assert body["events"] == []
    assert await logged_versions(runtime, "r1") == [1, 2, 2]
    assert len(await outbox_rows(runtime, "r1")) == 2


async def test_rejected_command_leaves_nothing(runtime: Process) -> None:
    await open_room(runtime, "r1", "bob")
    await run(runtime, "r1", "m1", c.TakeMic(user_id="bob", seat=0))
    before = await logged_versions(runtime, "r1")
    with pytest.raises(errors.SeatTaken):
        await run(runtime, "r1", "m2", c.TakeMic(user_id="owner", seat=0))
    with pytest.raises(errors.NotMember):
        await run(runtime, "r1", "m3", c.TakeMic(user_id="ghost", seat=1))
    assert await logged_versions(runtime, "r1") == before == [1, 2, 3]
    assert await count(runtime, t.room_outbox) == 3


async def test_unknown_room_is_404_and_keeps_no_cell(runtime: Process) -> None:
    with pytest.raises(errors.RoomNotFound):
        await run(runtime, "nope", "j1", c.JoinRoom(user_id="bob"))
    assert runtime.registry.peek(APP, "nope") is None
    with pytest.raises(errors.RoomNotFound):
        await runtime.service.room(APP, "nope")


async def test_gift_debits_the_wallet_once(runtime: Process, wallet: FakeWallet) -> None:
    await open_room(runtime, "r1", "bob")
    price = runtime.service.rules.gifts["rose"].price
    body = await run(runtime, "r1", "g1", c.SendGift(sender_id="bob", receiver_id="owner", gift_id="rose", count=3))
    again = await run(runtime, "r1", "g1", c.SendGift(sender_id="bob", receiver_id="owner", gift_id="rose", count=3))
    assert again["replayed"] is True
    assert body["room"]["heat"] == 3 * price
    assert wallet.balances[(APP, "bob")] == 10_000 - 3 * price
    assert len(wallet.debits) == 1


async def test_insufficient_balance_leaves_no_trace(runtime: Process, wallet: FakeWallet) -> None:
    await open_room(runtime, "r1", "bob")
    rows_before = await count(runtime, t.room_outbox)
    with pytest.raises(errors.InsufficientBalance):
        await run(runtime, "r1", "g1", c.SendGift(sender_id="bob", receiver_id="owner", gift_id="crown", count=9))
    assert await count(runtime, t.room_outbox) == rows_before
    assert await count(runtime, t.wallet_pending_debit) == 0
    assert await logged_versions(runtime, "r1") == [1, 2]
    assert wallet.balances.get((APP, "bob"), 10_000) == 10_000
    assert (await runtime.service.room(APP, "r1"))["heat"] == 0


async def test_wallet_down_answers_503_and_commits_nothing(runtime: Process, wallet: FakeWallet) -> None:
    await open_room(runtime, "r1", "bob")
    wallet.down = True
    gift = c.SendGift(sender_id="bob", receiver_id="owner", gift_id="rose", count=1)
    with pytest.raises(errors.Unavailable):
        await run(runtime, "r1", "g1", gift)
    assert await logged_versions(runtime, "r1") == [1, 2]
    wallet.down = False
    body = await run(runtime, "r1", "g1", gift)
    assert body["version"] == 3
    assert len(wallet.debits) == 1


async def test_wallet_timeout_after_debit_never_charges_twice(
    runtime_factory: RuntimeFactory, wallet: FakeWallet
) -> None:
    async with runtime_factory(**{"wallet.timeout": "50ms"}) as rt:
        await open_room(rt, "r1", "bob")
        price = rt.service.rules.gifts["rose"].price
        gift = c.SendGift(sender_id="bob", receiver_id="owner", gift_id="rose", count=2)
        wallet.fail_after_debit = True
        with pytest.raises(errors.Unavailable):
            await run(rt, "r1", "g1", gift)
        wallet.fail_after_debit = False
        wallet.delay_s = 0.2  # slower than the timeout: ambiguous again
        with pytest.raises(errors.Unavailable):
            await run(rt, "r1", "g1", gift)
        wallet.delay_s = 0
        await run(rt, "r1", "g1", gift)
        assert wallet.balances[(APP, "bob")] == 10_000 - 2 * price


async def test_reconciliation_refunds_orphan_debits_only(
    runtime_factory: RuntimeFactory, wallet: FakeWallet, clock: Clock
) -> None:
    async with runtime_factory(**{"wallet.reconcile_after": "10m"}) as rt:
        await open_room(rt, "r1", "bob")
        price = rt.service.rules.gifts["rose"].price
        await run(rt, "r1", "ok", c.SendGift(sender_id="bob", receiver_id="owner", gift_id="rose", count=1))
        # the gift's commit deleted its journal entry: nothing a pruned command log could later misread
        # (an entry reached after room.idempotency_retention looked like an orphan; found by review)
        assert await count(rt, t.wallet_pending_debit) == 0
        wallet.fail_after_debit = True
        with pytest.raises(errors.Unavailable):
            await run(rt, "r1", "orphan", c.SendGift(sender_id="bob", receiver_id="owner", gift_id="rose", count=5))
        wallet.fail_after_debit = False
        assert wallet.balances[(APP, "bob")] == 10_000 - 6 * price

        early = await rt.reconciler.run_once()
        assert early.checked == 0  # nothing is old enough yet
        clock.advance(11 * 60_000)
        report = await rt.reconciler.run_once()
        assert (report.checked, report.claimed, report.refunded) == (1, 0, 1)
        assert wallet.balances[(APP, "bob")] == 10_000 - price
        assert await count(rt, t.wallet_pending_debit) == 0
        assert (await rt.reconciler.run_once()).checked == 0


async def test_a_debit_whose_command_id_another_command_took_is_refunded(
    runtime_factory: RuntimeFactory, wallet: FakeWallet, clock: Clock
) -> None:
    """A gift's outcome unknown (its debit went out, the answer did not come back), the client sends
    another command under the same id. It commits; the gift never did: the debit is refunded, not
    counted as the gift's (found by review)."""
    async with runtime_factory(**{"wallet.reconcile_after": "10m"}) as rt:
        await open_room(rt, "r1", "bob")
        wallet.fail_after_debit = True
        with pytest.raises(errors.Unavailable):
            await run(rt, "r1", "reused", c.SendGift(sender_id="bob", receiver_id="owner", gift_id="rose", count=1))
        wallet.fail_after_debit = False
        await run(rt, "r1", "reused", c.TakeMic(user_id="bob", seat=1))  # the id, now for something else
        clock.advance(11 * 60_000)
        report = await rt.reconciler.run_once()
        assert (report.checked, report.claimed, report.refunded) == (1, 0, 1)
        assert wallet.balances[(APP, "bob")] == 10_000


async def orphans_in(
    rt: Process, wallet: FakeWallet, clock: Clock, rooms: list[str], *, failing: Exception
) -> Reconciler:
    """A debit and its journal entry in each of ``rooms`` (no command), and a reconciler whose turn on
    any room but r1 raises ``failing``."""
    journal = rt.commands.journal
    for n, room in enumerate(rooms):
        key = f"{APP}:{room}:gift-{n}"
        await wallet.debit(key=key, app_code=APP, user_id="bob", amount=10)
        await journal.record(JournalEntry(key, APP, room, f"gift-{n}", "bob", 10, clock.now_ms + n))

    @contextlib.asynccontextmanager
    async def room_turn(app_code: str, room_id: str) -> AsyncIterator[None]:
        if room_id != "r1":
            raise failing
        yield

    return Reconciler(
        journal=journal, wallet=wallet, store=rt.store, reconcile_after_ms=0, clock=lambda: clock.now_ms + 10,
        room_turn=room_turn,
    )


async def test_reconciliation_goes_on_past_entries_that_keep_failing(
    runtime_factory: RuntimeFactory, wallet: FakeWallet, clock: Clock
) -> None:
    """A page of entries that fail (their room held elsewhere, say) used to be all a pass ever looked
    at: every later orphan waited behind them for good (found by review)."""
    async with runtime_factory() as rt:
        journal = rt.commands.journal
        reconciler = await orphans_in(rt, wallet, clock, ["held", "held", "r1"], failing=errors.Retry("a lost race"))
        reconciler._batch_size = 2
        report = await reconciler.run_once()
        assert (report.checked, report.errors, report.refunded) == (3, 2, 1)
        assert wallet.balances[(APP, "bob")] == 10_000 - 20  # the third refunded; the held two stay for later
        assert [e.room_id for e in await journal.older_than(clock.now_ms + 10, limit=10)] == ["held", "held"]


async def test_an_entry_whose_room_does_not_load_waits_alone(
    runtime_factory: RuntimeFactory, wallet: FakeWallet, clock: Clock
) -> None:
    """A room whose state does not load (StoreInconsistent, or a bug) failed the whole pass, so every
    entry behind it waited for good (found by review): it is one entry's error now."""
    async with runtime_factory() as rt:
        journal = rt.commands.journal
        broken = StoreInconsistent("broken: the log does not follow the snapshot")
        reconciler = await orphans_in(rt, wallet, clock, ["broken", "r1"], failing=broken)
        with capture_logs() as logs:
            report = await reconciler.run_once()
        assert (report.checked, report.errors, report.refunded) == (2, 1, 1)
        assert [e["log_level"] for e in logs if e["event"] == "wallet_reconcile_failed"] == ["error"]
        assert [e.room_id for e in await journal.older_than(clock.now_ms + 10, limit=10)] == ["broken"]


async def test_fifty_concurrent_commands_get_consecutive_versions(runtime: Process) -> None:
    await open_room(runtime)
    bodies = await asyncio.gather(*(run(runtime, "r1", f"join-{i}", c.JoinRoom(user_id=f"user{i}")) for i in range(50)))
    assert sorted(b["version"] for b in bodies) == list(range(2, 52))
    assert await logged_versions(runtime, "r1") == list(range(1, 52))
    view = await runtime.service.room(APP, "r1")
    assert view["version"] == 51
    assert len(view["members"]) == 51
    rows = await outbox_rows(runtime, "r1")
    assert sorted(r.room_version for r in rows) == list(range(1, 52))


async def test_fenced_writer_cannot_commit(runtime: Process) -> None:
    await open_room(runtime, "r1", "bob")
    # another process takes the room: its lease bumps the durable epoch
    await runtime.store.take_lease_epoch(APP, "r1")
    with pytest.raises(errors.Retry):
        await run(runtime, "r1", "j2", c.JoinRoom(user_id="carol"))
    assert await logged_versions(runtime, "r1") == [1, 2]
    # the stale cell was dropped; the retry reloads, takes a new epoch and commits
    body = await run(runtime, "r1", "j2", c.JoinRoom(user_id="carol"))
    assert body["version"] == 3


async def test_lost_lease_answers_retry(runtime: Process) -> None:
    await open_room(runtime, "r1")
    runtime.leases.revoke(APP, "r1")  # type: ignore[attr-defined]
    with pytest.raises(errors.Retry):
        await run(runtime, "r1", "j1", c.JoinRoom(user_id="bob"))
    assert (await run(runtime, "r1", "j1", c.JoinRoom(user_id="bob")))["version"] == 2


async def test_a_room_that_closes_takes_its_last_snapshot_so_its_log_can_be_pruned(
    runtime_factory: RuntimeFactory, clock: Clock
) -> None:
    """A closed room takes no more commands, so without a snapshot at its close its log tail was kept
    for ever, and every prune pass scanned it again (found by review)."""
    async with runtime_factory(**{"room.snapshot_every_n": 50}) as rt:
        await open_room(rt, "r1", "bob")
        assert await count(rt, t.room_snapshot) == 0
        await run(rt, "r1", "close", c.CloseRoom(operator_id="owner"))
        async with rt.db.read() as conn:
            versions = (await conn.execute(sa.select(t.room_snapshot.c.version))).scalars().all()
        assert list(versions) == [3]
        clock.advance(8 * 86_400_000)
        assert await rt.store.prune_command_log(before_ms=clock() - 7 * 86_400_000, batch_size=100) == 3
        loaded = await rt.store.load_room(APP, "r1")
        assert loaded.state is not None and loaded.state.status == "closed" and loaded.state.version == 3


async def test_recovery_from_snapshot_and_log_equals_live_state(runtime_factory: RuntimeFactory, clock: Clock) -> None:
    async with runtime_factory(**{"room.snapshot_every_n": 7}) as rt:
        await open_room(rt, "r1")
        for i in range(30):
            await run(rt, "r1", f"j{i}", c.JoinRoom(user_id=f"u{i}"))
            clock.advance(1000)
        for i in range(0, 8):
            await run(rt, "r1", f"m{i}", c.TakeMic(user_id=f"u{i}", seat=i))
        for i in range(10):
            await run(rt, "r1", f"g{i}", c.SendGift(sender_id=f"u{i}", receiver_id="owner", gift_id="rocket", count=1))
        await run(rt, "r1", "leave3", c.LeaveRoom(user_id="u3"))
        await run(rt, "r1", "kick5", c.KickUser(operator_id="owner", target_id="u5"))
        await run(rt, "r1", "rejoin3", c.JoinRoom(user_id="u3"))
        cell = rt.registry.peek(APP, "r1")
        assert cell is not None and cell.state is not None
        live = cell.state
        assert live.treasure.box is not None  # the rocket gifts started a countdown
        assert await count(rt, t.room_snapshot) >= 1
    async with runtime_factory(**{"room.snapshot_every_n": 7}) as rt:
        loaded = await rt.store.load_room(APP, "r1")
        assert loaded.snapshot_version > 0
        assert loaded.state == live
        assert list(loaded.state.members) == list(live.members)


async def test_idle_cells_are_evicted_and_reload(runtime_factory: RuntimeFactory) -> None:
    async with runtime_factory(**{"room.idle_evict_after": "1ms"}) as rt:
        await open_room(rt, "r1", "bob")
        await asyncio.sleep(0.01)
        assert await rt.registry.evict_idle() == 1
        assert rt.registry.peek(APP, "r1") is None
        body = await run(rt, "r1", "j2", c.JoinRoom(user_id="carol"))
        assert body["version"] == 3
        assert [m["user_id"] for m in body["room"]["members"]] == ["owner", "bob", "carol"]


async def test_projection_failure_never_fails_a_command(runtime: Process, monkeypatch: pytest.MonkeyPatch) -> None:
    async def unavailable(*args: object) -> None:
        raise RuntimeError("projection store unavailable")

    monkeypatch.setattr(runtime.service.projections, "room_changed", unavailable)
    with capture_logs() as logs:
        body = await run(runtime, "r1", "c1", c.CreateRoom(owner_id="owner", title="x"))
    assert body["version"] == 1
    assert any(entry["event"] == "projection_failed" for entry in logs)


async def test_lines_logged_inside_a_command_name_it(runtime: Process, monkeypatch: pytest.MonkeyPatch) -> None:
    async def unavailable(*args: object) -> None:
        raise RuntimeError("projection store unavailable")

    monkeypatch.setattr(runtime.service.projections, "room_changed", unavailable)
    with capture_logs(processors=[merge_contextvars]) as logs:
        await run(runtime, "r1", "c1", c.CreateRoom(owner_id="owner", title="x"))
    failed = next(entry for entry in logs if entry["event"] == "projection_failed")
    assert (failed["app_code"], failed["room_id"], failed["command_id"]) == (APP, "r1", "c1")
    with capture_logs(processors=[merge_contextvars]) as logs:
        get_logger("test").info("after")
    assert "command_id" not in logs[0]  # unbound once the command is answered


async def test_room_list_and_presence_follow_commits(runtime: Process) -> None:
    await open_room(runtime, "r1", "bob")
    await open_room(runtime, "r2", "carol", "dave")
    rooms = await runtime.service.rooms(APP)
    assert [r["room_id"] for r in rooms] == ["r2", "r1"]  # busiest first
    assert await runtime.service.projections.room_of(APP, "bob") == "r1"
    await run(runtime, "r1", "close", c.CloseRoom(operator_id="owner"))
    assert [r["room_id"] for r in await runtime.service.rooms(APP)] == ["r2"]
    assert await runtime.service.projections.room_of(APP, "bob") is None


async def test_every_command_logs_timing_with_all_fields(runtime: Process) -> None:
    with capture_logs() as logs:
        await open_room(runtime, "r1", "bob")
        await run(runtime, "r1", "g", c.SendGift(sender_id="bob", receiver_id="owner", gift_id="rose", count=1))
        with pytest.raises(errors.NotMember):
            await run(runtime, "r1", "m", c.TakeMic(user_id="zed", seat=0))
    timings = [e for e in logs if e["event"] == "room_command_timing"]
    assert [(e["command"], e["result"]) for e in timings] == [
        ("CreateRoom", "ok"),
        ("JoinRoom", "ok"),
        ("SendGift", "ok"),
        ("TakeMic", "not_member"),
    ]
    for entry in timings:
        assert set(entry) >= TIMING_FIELDS
        assert entry["activity_ms"] == 0
    gift = timings[2]
    assert gift["wallet_debit_ms"] > 0
    assert gift["activity_async_outbox"] is True and gift["tencent_im_async_outbox"] is True
    assert timings[0]["version"] == 1 and timings[2]["version"] == 3


async def test_treasure_opens_only_when_due(runtime: Process, clock: Clock) -> None:
    await open_room(runtime, "r1", "bob")
    levels = runtime.service.rules.treasure_levels
    price = runtime.service.rules.gifts["rocket"].price
    count_needed = -(-levels[0] // price)
    body = await run(
        runtime, "r1", "g", c.SendGift(sender_id="bob", receiver_id="owner", gift_id="rocket", count=count_needed)
    )
    assert [e["type"] for e in body["events"]] == ["RoomGiftSent", "RoomTreasureCountdownStarted"]
    box = body["room"]["treasure"]
    assert box["state"] == "counting_down"
    wake = c.OpenTreasure(box_id=box["box_id"], level=1, open_at_ms=box["open_at_ms"])
    with pytest.raises(errors.TreasureTooEarly):
        await run(runtime, "r1", f"treasure-open:{box['box_id']}", wake)
    clock.now_ms = box["open_at_ms"]
    opened = await run(runtime, "r1", f"treasure-open:{box['box_id']}", wake)
    assert opened["events"][0]["type"] == "RoomTreasureOpened"
    duplicate = await run(runtime, "r1", f"treasure-open:{box['box_id']}", wake)
    assert duplicate["replayed"] is True
    rows = [r.event_type for r in await outbox_rows(runtime, "r1")]
    assert rows.count("RoomTreasureOpened") == 1


async def test_replays_with_a_cold_cache_answer_the_original(runtime_factory: RuntimeFactory) -> None:
    """After a restart the cell has no memory of ids: the log's unique key answers instead."""
    async with runtime_factory() as rt:
        created = await run(rt, "r1", "create", c.CreateRoom(owner_id="owner", title="x"))
        joined = await run(rt, "r1", "join", c.JoinRoom(user_id="bob"))
        await run(rt, "r1", "leave", c.LeaveRoom(user_id="bob"))
    async with runtime_factory() as rt:
        # decide would now say room_exists: the original answer wins
        assert await run(rt, "r1", "create", c.CreateRoom(owner_id="owner", title="x")) == {
            **created,
            "replayed": True,
        }
        # decide would now emit a fresh join: the commit finds the id taken, nothing new is written
        assert await run(rt, "r1", "join", c.JoinRoom(user_id="bob")) == {**joined, "replayed": True}
        with pytest.raises(errors.CommandIdReused):
            await run(rt, "r1", "leave", c.LeaveRoom(user_id="carol"))
        assert await logged_versions(rt, "r1") == [1, 2, 3]
        assert len(await outbox_rows(rt, "r1")) == 3
        view = await rt.service.room(APP, "r1")
        assert [m["user_id"] for m in view["members"]] == ["owner"]


async def test_database_failure_at_commit_answers_503_and_reloads(
    runtime: Process, monkeypatch: pytest.MonkeyPatch
) -> None:
    from roomservice.store.port import StoreUnavailable

    await open_room(runtime, "r1")
    real_save = runtime.store.save_mutation

    async def save_then_lose_the_answer(mutation: object) -> None:
        await real_save(mutation)  # type: ignore[arg-type]
        raise StoreUnavailable("connection lost during COMMIT")

    monkeypatch.setattr(runtime.store, "save_mutation", save_then_lose_the_answer)
    with pytest.raises(errors.Unavailable):
        await run(runtime, "r1", "j1", c.JoinRoom(user_id="bob"))
    assert runtime.registry.peek(APP, "r1") is None  # the cell's state could be stale: dropped
    monkeypatch.setattr(runtime.store, "save_mutation", real_save)
    # the commit did happen: the retry is answered from the log, and the reloaded state has bob
    again = await run(runtime, "r1", "j1", c.JoinRoom(user_id="bob"))
    assert again["replayed"] is True
    assert [m["user_id"] for m in (await runtime.service.room(APP, "r1"))["members"]] == ["owner", "bob"]


async def test_a_command_cancelled_mid_commit_leaves_no_stale_cell(
    runtime: Process, monkeypatch: pytest.MonkeyPatch
) -> None:
    await open_room(runtime, "r1")
    real_save = runtime.store.save_mutation
    committed = asyncio.Event()

    async def save_then_hang(mutation: object) -> None:
        await real_save(mutation)  # type: ignore[arg-type]
        committed.set()
        await asyncio.Event().wait()  # the client goes away before the answer

    monkeypatch.setattr(runtime.store, "save_mutation", save_then_hang)
    with capture_logs() as logs:
        task = asyncio.create_task(run(runtime, "r1", "j1", c.JoinRoom(user_id="bob")))
        await committed.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert [e["result"] for e in logs if e["event"] == "room_command_timing"] == ["cancelled"]
    monkeypatch.setattr(runtime.store, "save_mutation", real_save)
    assert runtime.registry.peek(APP, "r1") is None  # dropped: its state missed the commit
    body = await run(runtime, "r1", "j2", c.JoinRoom(user_id="carol"))  # no spurious 503 retry
    assert body["version"] == 3
    assert [m["user_id"] for m in body["room"]["members"]] == ["owner", "bob", "carol"]


@pytest.mark.parametrize("first", ["retry", "reconcile"])
async def test_a_gift_retried_during_reconciliation_is_paid_exactly_once(
    runtime_factory: RuntimeFactory, wallet: FakeWallet, clock: Clock, first: str
) -> None:
    """The reconciler holds the room as a command does. A retry in flight commits first (and
    restarts its debit's clock: nothing is refunded); a refund in flight finishes first (and
    the retry then charges again). Either way the gift stays and bob pays once."""
    async with runtime_factory(**{"wallet.reconcile_after": "10m"}) as rt:
        await open_room(rt, "r1", "bob")
        price = rt.service.rules.gifts["rose"].price
        gift = c.SendGift(sender_id="bob", receiver_id="owner", gift_id="rose", count=1)
        wallet.fail_after_debit = True
        with pytest.raises(errors.Unavailable):
            await run(rt, "r1", "g1", gift)
        wallet.fail_after_debit = False
        clock.advance(11 * 60_000)  # the orphan is old enough to refund

        wallet.delay_s = 0.2  # whoever reaches the wallet first holds the room a while
        calls = wallet.calls
        starter = run(rt, "r1", "g1", gift) if first == "retry" else rt.reconciler.run_once()
        started = asyncio.ensure_future(starter)
        async with asyncio.timeout(10):
            while wallet.calls == calls:  # it is inside the wallet call, holding the room
                await asyncio.sleep(0.005)
        second = rt.reconciler.run_once() if first == "retry" else run(rt, "r1", "g1", gift)
        results = await asyncio.gather(started, second)
        body, report = (results[0], results[1]) if first == "retry" else (results[1], results[0])
        assert body["room"]["heat"] == price  # type: ignore[index]
        assert report.refunded == (1 if first == "reconcile" else 0)  # type: ignore[union-attr]
        assert wallet.balances[(APP, "bob")] == 10_000 - price
