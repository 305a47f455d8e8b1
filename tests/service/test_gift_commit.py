"""Gifts with the embedded wallet: the debit is a write of the command's own SaveMutation
transaction (shared with other rooms' commands), so it commits with the command or not at all.

Every test runs on SQLite and MariaDB with the wallet as ``serve`` builds it (no fake).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import sqlalchemy as sa
from tests.service.conftest import Clock, make_settings
from tests.service.helpers import APP, count, logged_versions, run

from roomservice import errors
from roomservice.bootstrap import API, MAINTENANCE, Process
from roomservice.domain import commands as c
from roomservice.store import tables as t
from roomservice.store.sql import SqlRoomStore
from roomservice.wallet.embedded import EmbeddedWallet
from roomservice.wallet.journal import DebitJournal, JournalEntry
from roomservice.wallet.port import debit_key

START = 25  # the starting balance: two roses (10 each), not three
ROSE = 10

EmbeddedFactory = Callable[..., AbstractAsyncContextManager[Process]]


@pytest.fixture
def embedded_factory(database_url: str, tmp_path: Path, clock: Clock) -> EmbeddedFactory:
    def factory(**overrides: Any) -> AbstractAsyncContextManager[Process]:
        settings = make_settings(database_url, tmp_path, **{"wallet.starting_balance": START, **overrides})
        return Process.running(settings, clock=clock, roles=(API, MAINTENANCE), loops=False)

    return factory


@pytest_asyncio.fixture
async def rt(embedded_factory: EmbeddedFactory) -> AsyncIterator[Process]:
    async with embedded_factory() as process:
        assert isinstance(process.wallet, EmbeddedWallet)
        assert process.service.commit_wallet is process.wallet
        yield process


def rose(sender: str, count_: int = 1) -> c.SendGift:
    return c.SendGift(sender_id=sender, receiver_id="owner", gift_id="rose", count=count_)


async def open_room(rt: Process, room: str, *members: str) -> None:
    await run(rt, room, f"{room}-create", c.CreateRoom(owner_id="owner", title="Room"))
    for user in members:
        await run(rt, room, f"{room}-join-{user}", c.JoinRoom(user_id=user))


async def warm(rt: Process, room: str, user: str) -> None:
    """A first rose of ``user``, alone: the account exists before the gifts a test sends together (a
    refused first debit of an account the transaction may have just created rolls its batch back and
    is retried alone, which would hide what those tests look at)."""
    await run(rt, room, f"warm-{user}", rose(user))


def forget(rt: Process, room: str) -> None:
    """Drop the room's cell: the next command reloads it and remembers no command_id."""
    cell = rt.registry.peek(APP, room)
    assert cell is not None
    rt.registry.discard(cell)


async def debits(rt: Process) -> dict[str, tuple[str, int]]:
    async with rt.db.read() as conn:
        rows = (await conn.execute(sa.select(t.wallet_debit))).all()
    return {r.debit_key: (r.status, int(r.amount)) for r in rows}


async def gifts_logged(rt: Process) -> int:
    return await count(rt, t.room_command_log, t.room_command_log.c.command_type == "SendGift")


def after_retried(store: SqlRoomStore, before: dict[str, int]) -> int:
    return store.group_commit_stats()["retried_alone"] - before["retried_alone"]


async def test_a_gift_debits_once_in_its_commit_and_a_retry_is_replayed(rt: Process) -> None:
    await open_room(rt, "r1", "bob")
    first = await run(rt, "r1", "g1", rose("bob"))
    forget(rt, "r1")  # the retry is not answered from the cell: the command log's key catches it
    again = await run(rt, "r1", "g1", rose("bob"))

    assert again == {**first, "replayed": True}
    assert await rt.wallet.balance(APP, "bob") == START - ROSE
    assert await debits(rt) == {debit_key(APP, "r1", "g1"): ("debited", ROSE)}
    assert await count(rt, t.wallet_pending_debit) == 0  # nothing to reconcile: debit and command are one
    assert await gifts_logged(rt) == 1
    forget(rt, "r1")
    with pytest.raises(errors.CommandIdReused):
        await run(rt, "r1", "g1", rose("bob", 2))
    assert await rt.wallet.balance(APP, "bob") == START - ROSE


async def test_insufficient_balance_is_402_with_nothing_written(rt: Process) -> None:
    await open_room(rt, "r1", "bob", "carol")
    await run(rt, "r1", "g1", rose("bob", 2))
    versions = await logged_versions(rt, "r1")

    with pytest.raises(errors.InsufficientBalance):
        await run(rt, "r1", "g2", rose("bob"))  # 5 left
    with pytest.raises(errors.InsufficientBalance):
        await run(rt, "r1", "g3", rose("carol", 3))  # a first debit above the starting balance

    assert await logged_versions(rt, "r1") == versions
    assert await rt.wallet.balance(APP, "bob") == START - 2 * ROSE
    assert await rt.wallet.balance(APP, "carol") == START
    assert set(await debits(rt)) == {debit_key(APP, "r1", "g1")}
    assert await count(rt, t.wallet_pending_debit) == 0
    view = await rt.service.room(APP, "r1")
    assert view["heat"] == 2 * ROSE  # the cell kept its state: the refused gift never applied


async def test_a_committed_gift_retried_after_the_balance_ran_out_is_replayed_not_402(rt: Process) -> None:
    await open_room(rt, "r1", "bob")
    await run(rt, "r1", "g1", rose("bob"))
    await run(rt, "r1", "g2", rose("bob"))  # 5 left: a third rose would not be covered
    forget(rt, "r1")
    again = await run(rt, "r1", "g2", rose("bob"))
    assert again["replayed"] is True
    assert await rt.wallet.balance(APP, "bob") == START - 2 * ROSE


async def test_in_a_shared_transaction_a_refused_debit_fails_alone(rt: Process) -> None:
    rooms = [f"s{n}" for n in range(6)]
    for room in rooms:
        await open_room(rt, room, "bob", f"u{room}")
        await warm(rt, room, f"u{room}")
    await run(rt, "s0", "drain", rose("bob", 2))  # bob keeps 5: his next rose is refused
    store = rt.store
    assert isinstance(store, SqlRoomStore)
    before = store.group_commit_stats()

    results = await asyncio.gather(
        *(run(rt, room, "g", rose(f"u{room}")) for room in rooms[1:]),
        run(rt, "s0", "g", rose("bob")),
        return_exceptions=True,
    )

    assert all(isinstance(r, dict) and r["version"] == 5 for r in results[:-1]), results
    assert isinstance(results[-1], errors.InsufficientBalance)
    after = store.group_commit_stats()
    assert after["mutations"] - before["mutations"] == len(rooms)
    assert after["transactions"] - before["transactions"] < len(rooms)  # they shared
    assert after["retried_alone"] == before["retried_alone"]  # the refusal sank nobody else
    for room in rooms[1:]:
        assert await rt.wallet.balance(APP, f"u{room}") == START - 2 * ROSE
    assert await rt.wallet.balance(APP, "bob") == START - 2 * ROSE
    assert debit_key(APP, "s0", "g") not in await debits(rt)
    assert await gifts_logged(rt) == 2 * len(rooms)  # the warm-ups, "drain" and the five good ones


async def test_a_gifts_debit_and_rows_are_written_on_the_drivers_cursor(rt: Process) -> None:
    """Alone, in a shared transaction and on the debit's own path, a gift's statements (the debit's
    and the command's rows) go to the driver's cursor with the rest of its transaction: a batch
    holding a gift stays off SQLAlchemy's execution a statement (issue 12). Its listeners still
    hear each one, with no execution context."""
    rooms = [f"d{n}" for n in range(4)]
    for room in rooms:
        await open_room(rt, room, f"u{room}")
    heard: list[tuple[str, bool]] = []
    sync_engine = rt.db._sync_engine or rt.db.engine.sync_engine

    def listen(_conn: Any, _cursor: Any, statement: str, _params: Any, context: Any, _many: bool) -> None:
        if statement.startswith(("INSERT", "UPDATE")) and ("wallet_" in statement or "room_" in statement):
            heard.append((statement[:40], context is None))

    sa.event.listen(sync_engine, "before_cursor_execute", listen)
    try:
        await run(rt, rooms[0], "alone", rose(f"u{rooms[0]}"))
        results = await asyncio.gather(
            *(run(rt, room, "shared", rose(f"u{room}")) for room in rooms),
            *(run(rt, room, "join", c.JoinRoom(user_id="x")) for room in rooms),
            return_exceptions=True,
        )
        await rt.wallet.debit(key="own", app_code=APP, user_id=f"u{rooms[1]}", amount=1)  # the port's own path
    finally:
        sa.event.remove(sync_engine, "before_cursor_execute", listen)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert any("wallet_account" in s for s, _ in heard) and any("wallet_debit" in s for s, _ in heard)
    assert all(on_driver for _, on_driver in heard), [s for s, on_driver in heard if not on_driver]
    assert await rt.wallet.balance(APP, f"u{rooms[0]}") == START - 2 * ROSE
    assert await rt.wallet.balance(APP, f"u{rooms[1]}") == START - ROSE - 1


async def test_a_fenced_gift_in_a_shared_transaction_debits_nothing(rt: Process) -> None:
    rooms = [f"f{n}" for n in range(4)]
    for room in rooms:
        await open_room(rt, room, f"u{room}")
        await warm(rt, room, f"u{room}")
    await rt.store.take_lease_epoch(APP, "f0")  # another process took the room's lease
    store = rt.store
    assert isinstance(store, SqlRoomStore)
    before = store.group_commit_stats()

    results = await asyncio.gather(*(run(rt, room, "g", rose(f"u{room}")) for room in rooms), return_exceptions=True)

    assert isinstance(results[0], errors.Retry)
    assert all(isinstance(r, dict) for r in results[1:]), results
    assert after_retried(store, before) > 0  # its debit stood in the shared transaction: all undone, then alone
    assert await rt.wallet.balance(APP, "uf0") == START - ROSE  # its warm-up only
    assert debit_key(APP, "f0", "g") not in await debits(rt)
    for room in rooms[1:]:
        assert await rt.wallet.balance(APP, f"u{room}") == START - 2 * ROSE


async def test_a_debit_left_by_a_journaled_attempt_is_not_charged_again(rt: Process) -> None:
    """A debit made before its command committed (an attempt journaled and debited by the
    wallet on its own, then cut off): the command commits without charging again, in a
    shared transaction too, and reconciliation finds it claimed."""
    await open_room(rt, "r1", "bob", "carol")
    await open_room(rt, "r2", "dave")
    await warm(rt, "r2", "dave")
    key = debit_key(APP, "r1", "g1")
    await DebitJournal(rt.db).record(JournalEntry(key, APP, "r1", "g1", "bob", ROSE, 0))
    await rt.wallet.debit(key=key, app_code=APP, user_id="bob", amount=ROSE)
    store = rt.store
    assert isinstance(store, SqlRoomStore)
    before = store.group_commit_stats()

    results = await asyncio.gather(run(rt, "r1", "g1", rose("bob")), run(rt, "r2", "g1", rose("dave")))

    assert [r["replayed"] for r in results] == [False, False]
    assert after_retried(store, before) > 0  # the existing key was settled in a transaction of its own
    assert await rt.wallet.balance(APP, "bob") == START - ROSE
    assert await rt.wallet.balance(APP, "dave") == START - 2 * ROSE
    report = await rt.reconciler.run_once()
    assert (report.claimed, report.refunded) == (1, 0)
    assert await rt.wallet.balance(APP, "bob") == START - ROSE


async def test_a_gift_whose_commit_fails_debits_nothing_and_its_retry_charges_once(rt: Process) -> None:
    """The crash between debit and commit cannot happen: a COMMIT that fails takes the debit
    with it (503), and the retry with the same command_id charges once."""
    await open_room(rt, "r1", "bob")
    sync_engine = rt.db._sync_engine or rt.db.engine.sync_engine
    failing = [True]

    def fail_commit(conn: sa.Connection) -> None:  # the connection is lost as the COMMIT goes out
        if failing[0]:
            failing[0] = False
            conn.invalidate()
            raise sa.exc.OperationalError("COMMIT", {}, Exception("connection lost during COMMIT"))

    sa.event.listen(sync_engine, "commit", fail_commit)
    try:
        with pytest.raises(errors.Unavailable):
            await run(rt, "r1", "g1", rose("bob"))
    finally:
        sa.event.remove(sync_engine, "commit", fail_commit)
    assert await rt.wallet.balance(APP, "bob") == START
    assert await debits(rt) == {}
    body = await run(rt, "r1", "g1", rose("bob"))
    assert body["replayed"] is False
    assert await rt.wallet.balance(APP, "bob") == START - ROSE
    assert await gifts_logged(rt) == 1


async def test_a_gift_command_id_used_again_after_its_log_row_was_pruned_is_409_not_free(
    embedded_factory: EmbeddedFactory, clock: Clock
) -> None:
    """The command log forgets a command_id after room.idempotency_retention; the debit key (app,
    room, command_id) stays in the wallet. A gift sent again under that id found the old debit and
    committed without charging: a free gift, on purpose if a client liked (found by review). An
    existing debit in the commit belongs to a committed command (nothing else writes one): 409."""
    async with embedded_factory(**{"room.snapshot_every_n": 1}) as rt:  # a snapshot lets the log be pruned
        await _reused_after_retention(rt, clock)


async def _reused_after_retention(rt: Process, clock: Clock) -> None:
    await open_room(rt, "r1", "bob")
    first = await run(rt, "r1", "g1", rose("bob"))
    clock.advance(8 * 86_400_000)
    assert await rt.store.prune_command_log(before_ms=clock() - 7 * 86_400_000, batch_size=1000) > 0
    forget(rt, "r1")  # a restart, or the idle sweep: nothing remembers g1

    with pytest.raises(errors.CommandIdReused, match="committed earlier"):
        await run(rt, "r1", "g1", rose("bob"))
    assert await rt.wallet.balance(APP, "bob") == START - ROSE
    assert await gifts_logged(rt) == 0  # the first gift's row was pruned; nothing new was logged
    view = await rt.service.room(APP, "r1")
    assert view["heat"] == first["room"]["heat"]  # the room did not take a second gift
    again = await run(rt, "r1", "g2", rose("bob"))  # a new command_id is charged as usual
    assert again["replayed"] is False and await rt.wallet.balance(APP, "bob") == START - 2 * ROSE
