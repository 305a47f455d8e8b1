"""The embedded wallet: balances and debits in the service's own database tables.

A debit is one write transaction: claim the key (insert-or-ignore), then a
guarded ``balance >= amount`` update; an insufficient balance rolls both back.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

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
        # The account row is created in its own transaction: creating it inside the
        # debit would let two first debits of one user deadlock on MariaDB.
        if (app_code, user_id) not in self._known_accounts:
            async with self._db.write() as conn:
                await self._ensure_account(conn, app_code, user_id, now)
            self._known_accounts.add((app_code, user_id))
        async with self._db.write() as conn:
            claimed = await conn.execute(
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
                existing = await self._get(conn, key)
                assert existing is not None
                if (existing.app_code, existing.user_id, existing.amount) != (app_code, user_id, amount):
                    raise DebitKeyConflict(key)
                if existing.status == DEBITED:
                    return existing
                # refunded by reconciliation, now retried: charge it again (net once)
                await conn.execute(
                    sa.update(t.wallet_debit)
                    .where(t.wallet_debit.c.debit_key == key)
                    .values(status=DEBITED, updated_at_ms=now)
                )
            charged = await conn.execute(
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

    async def lookup(self, key: str) -> Debit | None:
        async with self._db.read() as conn:
            return await self._get(conn, key)

    async def refund(self, key: str) -> Debit | None:
        now = self._clock()
        async with self._db.write() as conn:
            debit = await self._get(conn, key)
            if debit is None or debit.status == REFUNDED:
                return debit
            flipped = await conn.execute(
                sa.update(t.wallet_debit)
                .where(t.wallet_debit.c.debit_key == key, t.wallet_debit.c.status == DEBITED)
                .values(status=REFUNDED, updated_at_ms=now)
            )
            if flipped.rowcount == 1:
                await conn.execute(
                    sa.update(t.wallet_account)
                    .where(t.wallet_account.c.app_code == debit.app_code, t.wallet_account.c.user_id == debit.user_id)
                    .values(balance=t.wallet_account.c.balance + debit.amount, updated_at_ms=now)
                )
        return Debit(debit.key, debit.app_code, debit.user_id, debit.amount, REFUNDED)

    async def balance(self, app_code: str, user_id: str) -> int:
        async with self._db.read() as conn:
            value = await conn.scalar(
                sa.select(t.wallet_account.c.balance).where(
                    t.wallet_account.c.app_code == app_code, t.wallet_account.c.user_id == user_id
                )
            )
        return self._starting_balance if value is None else int(value)

    async def _ensure_account(self, conn: AsyncConnection, app_code: str, user_id: str, now: int) -> None:
        await conn.execute(
            insert_or_ignore(t.wallet_account).values(
                app_code=app_code, user_id=user_id, balance=self._starting_balance, updated_at_ms=now
            )
        )

    @staticmethod
    async def _get(conn: AsyncConnection, key: str) -> Debit | None:
        row = (await conn.execute(sa.select(t.wallet_debit).where(t.wallet_debit.c.debit_key == key))).one_or_none()
        if row is None:
            return None
        return Debit(row.debit_key, row.app_code, row.user_id, int(row.amount), row.status)
