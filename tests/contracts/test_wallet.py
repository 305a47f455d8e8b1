"""One contract suite for the wallet port, run against every adapter.

Adapters: fake, embedded on SQLite and MariaDB, and http (the HTTP adapter
against the test wallet server of ``tests/wallet_server.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import pytest_asyncio
from tests.conftest import migrated_database
from tests.wallet_server import running_wallet_server

from roomservice.wallet.embedded import EmbeddedWallet
from roomservice.wallet.fake import FakeWallet
from roomservice.wallet.port import (
    DEBITED,
    REFUNDED,
    DebitKeyConflict,
    InsufficientFunds,
    Wallet,
    debit_key,
)

START = 1_000


@pytest.fixture(params=["fake", "embedded-sqlite", "embedded-mariadb", "http"])
def wallet_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest_asyncio.fixture
async def wallet(wallet_kind: str, request: pytest.FixtureRequest) -> AsyncIterator[Wallet]:
    if wallet_kind == "fake":
        yield FakeWallet(starting_balance=START)
        return
    if wallet_kind == "http":
        async with running_wallet_server(starting_balance=START) as server:
            client = server.client(timeout_s=5.0)
            try:
                yield client
            finally:
                await client.aclose()
        return
    url: str = request.getfixturevalue("sqlite_url" if wallet_kind.endswith("sqlite") else "mariadb_url")
    async with migrated_database(url) as db:
        yield EmbeddedWallet(db, starting_balance=START, clock=lambda: 1_000_000)


def test_debit_key_is_derived_from_app_room_and_command() -> None:
    assert debit_key("a", "r", "c1") != debit_key("a", "r", "c2")
    assert debit_key("a", "r", "c1") != debit_key("a", "r2", "c1")
    assert debit_key("a", "r", "c1") == debit_key("a", "r", "c1")


async def test_debit_once_per_key(wallet: Wallet) -> None:
    first = await wallet.debit(key="k1", app_code="app", user_id="bob", amount=300)
    again = await wallet.debit(key="k1", app_code="app", user_id="bob", amount=300)
    assert again == replace(first, charged=False)  # the same debit, and the wallet says it moved no money
    assert first.status == DEBITED and first.charged
    assert await wallet.balance("app", "bob") == START - 300
    await wallet.refund("k1")
    charged_again = await wallet.debit(key="k1", app_code="app", user_id="bob", amount=300)
    assert (charged_again.status, charged_again.charged) == (DEBITED, True)  # refunded, then charged: net once
    assert await wallet.balance("app", "bob") == START - 300


async def test_insufficient_funds_debits_nothing(wallet: Wallet) -> None:
    with pytest.raises(InsufficientFunds):
        await wallet.debit(key="big", app_code="app", user_id="bob", amount=START + 1)
    assert await wallet.balance("app", "bob") == START
    assert await wallet.lookup("big") is None
    ok = await wallet.debit(key="big", app_code="app", user_id="bob", amount=START)
    assert ok.amount == START
    assert await wallet.balance("app", "bob") == 0


async def test_key_reuse_with_other_amount_is_a_conflict(wallet: Wallet) -> None:
    await wallet.debit(key="k1", app_code="app", user_id="bob", amount=100)
    with pytest.raises(DebitKeyConflict):
        await wallet.debit(key="k1", app_code="app", user_id="bob", amount=200)
    with pytest.raises(DebitKeyConflict):
        await wallet.debit(key="k1", app_code="app", user_id="carol", amount=100)
    assert await wallet.balance("app", "bob") == START - 100
    assert await wallet.balance("app", "carol") == START


async def test_lookup_and_refund_are_idempotent(wallet: Wallet) -> None:
    assert await wallet.refund("missing") is None
    await wallet.debit(key="k1", app_code="app", user_id="bob", amount=100)
    found = await wallet.lookup("k1")
    assert found is not None and (found.user_id, found.amount, found.status) == ("bob", 100, DEBITED)
    refunded = await wallet.refund("k1")
    assert refunded is not None and refunded.status == REFUNDED
    assert (await wallet.refund("k1")) is not None
    assert await wallet.balance("app", "bob") == START
    looked = await wallet.lookup("k1")
    assert looked is not None and looked.status == REFUNDED


async def test_balances_are_per_app(wallet: Wallet) -> None:
    await wallet.debit(key="k1", app_code="app1", user_id="bob", amount=100)
    assert await wallet.balance("app2", "bob") == START


async def test_concurrent_debits_never_overdraw(wallet: Wallet) -> None:
    async def attempt(i: int) -> bool:
        try:
            await wallet.debit(key=f"k{i}", app_code="app", user_id="bob", amount=300)
        except InsufficientFunds:
            return False
        return True

    results = await asyncio.gather(*(attempt(i) for i in range(8)))
    assert sum(results) == START // 300
    assert await wallet.balance("app", "bob") == START - 300 * (START // 300)


async def test_concurrent_same_key_debits_once(wallet: Wallet) -> None:
    results = await asyncio.gather(
        *(wallet.debit(key="same", app_code="app", user_id="bob", amount=250) for _ in range(6)),
        return_exceptions=True,
    )
    assert all(not isinstance(r, BaseException) for r in results), results
    assert await wallet.balance("app", "bob") == START - 250
