"""The embedded wallet: balances and debits in the service's own database tables.

A debit claims its key (insert-or-ignore) and makes a guarded ``balance >= amount``
update; an insufficient balance rolls both back. Two ways to run it:

* :meth:`EmbeddedWallet.debit` (the :class:`~roomservice.wallet.port.Wallet` port):
  one write transaction of its own.
* :meth:`EmbeddedWallet.debit_in_commit`: the debit as an
  :class:`~roomservice.store.port.AttachedWrite` of the gift's own SaveMutation
  transaction (which other rooms' mutations may share): the debit commits with its
  command or not at all, so neither exists without the other and nothing is
  journaled for reconciliation (docs/benchmarks.md, "Gift path").

Statements are built once, at import: a statement built per call was most of a
debit's CPU (SQLAlchemy's cache key of a new statement, py-spy, issue 12). A debit's
statements go to the driver's cursor (:mod:`roomservice.store.writes`), as the rest
of its command's transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy import Connection
from sqlalchemy.dialects import mysql

from roomservice.store import tables as t
from roomservice.store.database import Database, insert_or_ignore
from roomservice.store.port import NeedsOwnTransaction, Writes
from roomservice.store.writes import run_writes
from roomservice.wallet.port import (
    DEBITED,
    REFUNDED,
    Debit,
    DebitKeyConflict,
    InsufficientFunds,
)

_account, _debits = t.wallet_account, t.wallet_debit

_IS_ACCOUNT = (_account.c.app_code == sa.bindparam("b_app")) & (_account.c.user_id == sa.bindparam("b_user"))
# A user's first debit creates the account in the debit's transaction. SQLite: INSERT OR IGNORE,
# whose rowcount says whether this call created it. MySQL/MariaDB: a duplicate-key "update" to
# itself, which takes an exclusive lock on an existing row where INSERT IGNORE takes a shared
# one: two first debits of one user then wait for each other instead of deadlocking when both
# turn their shared lock into the balance update's exclusive one (its rowcount says nothing).
_OPEN_ACCOUNT: Final = insert_or_ignore(_account)
_OPEN_ACCOUNT_MYSQL: Final = mysql.insert(_account).on_duplicate_key_update(app_code=_account.c.app_code)
_CLAIM_KEY: Final = insert_or_ignore(_debits)
_CHARGE: Final = (
    sa.update(_account)
    .where(_IS_ACCOUNT & (_account.c.balance >= sa.bindparam("b_amount")))
    .values(balance=_account.c.balance - sa.bindparam("b_amount"), updated_at_ms=sa.bindparam("b_now"))
)
_CREDIT: Final = (
    sa.update(_account)
    .where(_IS_ACCOUNT)
    .values(balance=_account.c.balance + sa.bindparam("b_amount"), updated_at_ms=sa.bindparam("b_now"))
)
_BALANCE: Final = sa.select(_account.c.balance).where(_IS_ACCOUNT)
_GET: Final = sa.select(
    _debits.c.debit_key, _debits.c.app_code, _debits.c.user_id, _debits.c.amount, _debits.c.status
).where(_debits.c.debit_key == sa.bindparam("b_key"))
_JOURNALED: Final = sa.select(t.wallet_pending_debit.c.debit_key).where(
    t.wallet_pending_debit.c.debit_key == sa.bindparam("b_key")
)
_SET_STATUS: Final = (
    sa.update(_debits)
    .where(_debits.c.debit_key == sa.bindparam("b_key"), _debits.c.status == sa.bindparam("b_from"))
    .values(status=sa.bindparam("b_to"), updated_at_ms=sa.bindparam("b_now"))
)


class EmbeddedWallet:
    def __init__(self, db: Database, *, starting_balance: int, clock: Callable[[], int]) -> None:
        self._db = db
        self._starting_balance = starting_balance
        self._clock = clock
        self._known_accounts: set[tuple[str, str]] = set()  # rows known to exist; accounts are never deleted

    async def debit(self, *, key: str, app_code: str, user_id: str, amount: int) -> Debit:
        debit = await run_writes(self._db, _debit, self._request(key, app_code, user_id, amount))
        self._known_accounts.add((app_code, user_id))
        return debit

    async def debit_in_commit(self, *, key: str, app_code: str, user_id: str, amount: int) -> CommitDebit:
        """The debit, to be written in the command's own SaveMutation transaction, which must
        be on this wallet's database (the store's: the bootstrap hands it only that one)."""
        return CommitDebit(self._request(key, app_code, user_id, amount), self._known_accounts)

    def _request(self, key: str, app_code: str, user_id: str, amount: int) -> _Request:
        known = (app_code, user_id) in self._known_accounts
        return _Request(key, app_code, user_id, amount, self._clock(), None if known else self._starting_balance)

    async def lookup(self, key: str) -> Debit | None:
        return await self._db.run_read(_get, key)

    async def refund(self, key: str) -> Debit | None:
        return await self._db.run_write(_refund, key, self._clock())

    async def balance(self, app_code: str, user_id: str) -> int:
        value = await self._db.run_read(_balance, app_code, user_id)
        return self._starting_balance if value is None else value


@dataclass(frozen=True, slots=True)
class _Request:
    key: str
    app_code: str
    user_id: str
    amount: int
    now: int
    new_account: int | None  # first create the account with this balance if it does not exist

    def account(self) -> dict[str, Any]:
        return {"b_app": self.app_code, "b_user": self.user_id, "b_amount": self.amount, "b_now": self.now}

    async def open_account(self, writes: Writes) -> bool:
        """Create the account if this request says so and it does not exist; False if it
        certainly existed (on MySQL/MariaDB that cannot be told: True whenever it asked)."""
        if self.new_account is None:
            return False
        row = {"app_code": self.app_code, "user_id": self.user_id, "balance": self.new_account,
               "updated_at_ms": self.now}
        if writes.dialect.name == "sqlite":
            return await writes.execute_rendered(_OPEN_ACCOUNT, row) == 1
        await writes.execute_rendered(_OPEN_ACCOUNT_MYSQL, row)
        return True

    async def claim_key(self, writes: Writes) -> bool:
        """Insert the debit row; False if the key exists already."""
        row = {"debit_key": self.key, "app_code": self.app_code, "user_id": self.user_id, "amount": self.amount,
               "status": DEBITED, "created_at_ms": self.now, "updated_at_ms": self.now}
        return await writes.execute_rendered(_CLAIM_KEY, row) == 1

    async def charge(self, writes: Writes) -> bool:
        """The guarded balance update; False (nothing written) if the balance does not cover it."""
        return await writes.execute_rendered(_CHARGE, self.account()) == 1

    def insufficient(self) -> InsufficientFunds:
        return InsufficientFunds(f"balance of {self.user_id} does not cover {self.amount}")


@dataclass(frozen=True, slots=True)
class CommitDebit:
    """A gift's debit as an attached write of its SaveMutation (:class:`~roomservice.store.port.AttachedWrite`)."""

    request: _Request
    known_accounts: set[tuple[str, str]]

    @property
    def lock_order(self) -> tuple[str, ...]:
        return (self.request.app_code, self.request.user_id)

    async def write(self, writes: Writes, *, shared: bool) -> None:
        request = self.request
        if not shared:
            await _debit(writes, request, in_commit=True)
            return
        # In a transaction shared with other rooms' commands: the common case only, and a
        # failure that leaves nothing written; anything else is decided in a transaction of its own.
        opened = await request.open_account(writes)
        if not await request.charge(writes):
            if opened:  # the account row it may have created would stay
                raise NeedsOwnTransaction("a refused debit of an account that may be new")
            raise request.insufficient()
        if not await request.claim_key(writes):  # charged already, refunded, or another amount: see _debit
            raise NeedsOwnTransaction(f"debit key {request.key!r} exists")

    def committed(self) -> None:
        self.known_accounts.add((self.request.app_code, self.request.user_id))


async def _debit(writes: Writes, request: _Request, *, in_commit: bool = False) -> Debit:
    """The debit in a transaction of its own (raising rolls all of it back); ``in_commit``: the
    command's own transaction, which an existing debit of the key never belongs to."""
    await request.open_account(writes)
    if not await request.claim_key(writes):
        found = await writes.rows(_GET, {"b_key": request.key})
        assert found
        existing = _debit_of(found[0])
        asked = (request.app_code, request.user_id, request.amount)
        if (existing.app_code, existing.user_id, existing.amount) != asked:
            raise DebitKeyConflict(request.key)
        if existing.status == DEBITED:
            if in_commit and not await writes.rows(_JOURNALED, {"b_key": request.key}):
                # A debit in the commit exists only with its committed command: this command_id was
                # used before, its log row since pruned (room.idempotency_retention). Never a gift
                # for free. (A journaled key is an attempt through the wallet port whose command did
                # not commit: its retry takes that debit, as the port's own path does.)
                raise DebitKeyConflict(request.key, reused=True)
            return replace(existing, charged=False)
        # refunded by reconciliation, now retried: charge it again (net once)
        flip = {"b_key": request.key, "b_from": REFUNDED, "b_to": DEBITED, "b_now": request.now}
        await writes.execute_rendered(_SET_STATUS, flip)
    if not await request.charge(writes):  # raising rolls the key claim back too
        raise request.insufficient()
    return Debit(request.key, request.app_code, request.user_id, request.amount, DEBITED)


def _refund(conn: Connection, key: str, now: int) -> Debit | None:
    debit = _get(conn, key)
    if debit is None or debit.status == REFUNDED:
        return debit
    flipped = conn.execute(_SET_STATUS, {"b_key": key, "b_from": DEBITED, "b_to": REFUNDED, "b_now": now})
    if flipped.rowcount == 1:
        credit = {"b_app": debit.app_code, "b_user": debit.user_id, "b_amount": debit.amount, "b_now": now}
        conn.execute(_CREDIT, credit)
    return Debit(debit.key, debit.app_code, debit.user_id, debit.amount, REFUNDED)


def _balance(conn: Connection, app_code: str, user_id: str) -> int | None:
    value = conn.scalar(_BALANCE, {"b_app": app_code, "b_user": user_id})
    return None if value is None else int(value)


def _get(conn: Connection, key: str) -> Debit | None:
    row = conn.execute(_GET, {"b_key": key}).one_or_none()
    return None if row is None else _debit_of(tuple(row))


def _debit_of(row: tuple[Any, ...]) -> Debit:
    """A Debit from a row of ``_GET``."""
    key, app_code, user_id, amount, status = row
    return Debit(key, app_code, user_id, int(amount), status)
