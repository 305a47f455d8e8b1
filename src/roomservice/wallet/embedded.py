"""The embedded wallet: balances and debits in the service's own database tables.

A debit is one write transaction: claim the key (insert-or-ignore), then a
guarded ``balance >= amount`` update; an insufficient balance rolls both back.
Each call is one ``run_write``/``run_read`` unit: on SQLite one hop to the
database thread instead of one aiosqlite hop per statement (a gift's debit was
the slowest part of a gift command; docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy import Connection

from roomservice.store import tables as t
from roomservice.store.database import Database, insert_or_ignore
from roomservice.wallet.port import (
    DEBITED,
    REFUNDED,
    Debit,
    DebitKeyConflict,
    InsufficientFunds,
)


class EmbeddedWallet:
    def __init__(self, db: Database, *, starting_balance: int, clock: Callable[[], int]) -> None:
        self._db = db
        self._starting_balance = starting_balance
        self._clock = clock
        self._known_accounts: set[tuple[str, str]] = set()  # rows known to exist; accounts are never deleted

    async def debit(self, *, key: str, app_code: str, user_id: str, amount: int) -> Debit:
        now = self._clock()
        account = None
        if (app_code, user_id) not in self._known_accounts:
            if self._db.is_sqlite:  # one writer: the account row goes in the debit's own transaction
                account = self._starting_balance
            else:  # its own transaction: inside the debit, two first debits of one user deadlock on MariaDB
                await self._db.run_write(_ensure_account, app_code, user_id, self._starting_balance, now)
        debit = await self._db.run_write(_debit, key, app_code, user_id, amount, now, account)
        self._known_accounts.add((app_code, user_id))
        return debit

    async def lookup(self, key: str) -> Debit | None:
        return await self._db.run_read(_get, key)

    async def refund(self, key: str) -> Debit | None:
        return await self._db.run_write(_refund, key, self._clock())

    async def balance(self, app_code: str, user_id: str) -> int:
        value = await self._db.run_read(_balance, app_code, user_id)
        return self._starting_balance if value is None else value


def _ensure_account(conn: Connection, app_code: str, user_id: str, balance: int, now: int) -> None:
    conn.execute(
        insert_or_ignore(t.wallet_account).values(
            app_code=app_code, user_id=user_id, balance=balance, updated_at_ms=now
        )
    )


def _debit(
    conn: Connection, key: str, app_code: str, user_id: str, amount: int, now: int, new_account: int | None
) -> Debit:
    """The debit; ``new_account``: first create the account with this balance if it does not exist."""
    if new_account is not None:
        _ensure_account(conn, app_code, user_id, new_account, now)
    claimed = conn.execute(
        insert_or_ignore(t.wallet_debit).values(
            debit_key=key,
            app_code=app_code,
            user_id=user_id,
            amount=amount,
            status=DEBITED,
            created_at_ms=now,
            updated_at_ms=now,
        )
    )
    if claimed.rowcount != 1:
        existing = _get(conn, key)
        assert existing is not None
        if (existing.app_code, existing.user_id, existing.amount) != (app_code, user_id, amount):
            raise DebitKeyConflict(key)
        if existing.status == DEBITED:
            return existing
        # refunded by reconciliation, now retried: charge it again (net once)
        conn.execute(
            sa.update(t.wallet_debit).where(t.wallet_debit.c.debit_key == key).values(status=DEBITED, updated_at_ms=now)
        )
    charged = conn.execute(
        sa.update(t.wallet_account)
        .where(
            t.wallet_account.c.app_code == app_code,
            t.wallet_account.c.user_id == user_id,
            t.wallet_account.c.balance >= amount,
        )
        .values(balance=t.wallet_account.c.balance - amount, updated_at_ms=now)
    )
    if charged.rowcount != 1:  # raising rolls the key claim back too
        raise InsufficientFunds(f"balance of {user_id} does not cover {amount}")
    return Debit(key, app_code, user_id, amount, DEBITED)


def _refund(conn: Connection, key: str, now: int) -> Debit | None:
    debit = _get(conn, key)
    if debit is None or debit.status == REFUNDED:
        return debit
    flipped = conn.execute(
        sa.update(t.wallet_debit)
        .where(t.wallet_debit.c.debit_key == key, t.wallet_debit.c.status == DEBITED)
        .values(status=REFUNDED, updated_at_ms=now)
    )
    if flipped.rowcount == 1:
        conn.execute(
            sa.update(t.wallet_account)
            .where(t.wallet_account.c.app_code == debit.app_code, t.wallet_account.c.user_id == debit.user_id)
            .values(balance=t.wallet_account.c.balance + debit.amount, updated_at_ms=now)
        )
    return Debit(debit.key, debit.app_code, debit.user_id, debit.amount, REFUNDED)


def _balance(conn: Connection, app_code: str, user_id: str) -> int | None:
    value = conn.scalar(
        sa.select(t.wallet_account.c.balance).where(
            t.wallet_account.c.app_code == app_code, t.wallet_account.c.user_id == user_id
        )
    )
    return None if value is None else int(value)


def _get(conn: Connection, key: str) -> Debit | None:
    row = conn.execute(sa.select(t.wallet_debit).where(t.wallet_debit.c.debit_key == key)).one_or_none()
    if row is None:
        return None
    return Debit(row.debit_key, row.app_code, row.user_id, int(row.amount), row.status)
