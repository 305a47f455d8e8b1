"""An in-memory wallet for unit tests, with switches for outages and slow answers."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from roomservice.wallet.port import (
    DEBITED,
    REFUNDED,
    Debit,
    DebitKeyConflict,
    InsufficientFunds,
    WalletUnavailable,
)


class FakeWallet:
    def __init__(self, *, starting_balance: int = 100_000) -> None:
        self.starting_balance = starting_balance
        self.balances: dict[tuple[str, str], int] = {}
        self.debits: dict[str, Debit] = {}
        self.down = False
        self.delay_s = 0.0
        self.fail_after_debit = False  # debit, then answer as if it timed out
        self.calls = 0

    async def _enter(self) -> None:
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.down:
            raise WalletUnavailable("wallet is down")

    async def debit(self, *, key: str, app_code: str, user_id: str, amount: int) -> Debit:
        await self._enter()
        existing = self.debits.get(key)
        if existing is not None and existing.status == DEBITED:
            if (existing.user_id, existing.amount) != (user_id, amount):
                raise DebitKeyConflict(key)
            return replace(existing, charged=False)
        account = (app_code, user_id)
        balance = self.balances.get(account, self.starting_balance)
        if balance < amount:
            raise InsufficientFunds(f"{user_id} has {balance}, needs {amount}")
        self.balances[account] = balance - amount
        debit = Debit(key, app_code, user_id, amount, DEBITED)
        self.debits[key] = debit
        if self.fail_after_debit:
            raise WalletUnavailable("timed out after debiting")
        return debit

    async def lookup(self, key: str) -> Debit | None:
        await self._enter()
        return self.debits.get(key)

    async def refund(self, key: str) -> Debit | None:
        await self._enter()
        debit = self.debits.get(key)
        if debit is None or debit.status == REFUNDED:
            return debit
        account = (debit.app_code, debit.user_id)
        self.balances[account] = self.balances.get(account, self.starting_balance) + debit.amount
        refunded = replace(debit, status=REFUNDED)
        self.debits[key] = refunded
        return refunded

    async def balance(self, app_code: str, user_id: str) -> int:
        await self._enter()
        return self.balances.get((app_code, user_id), self.starting_balance)
