"""The debit journal: the room service's durable record of the debits it asked the wallet for.

A gift journals its debit key before asking an external wallet, and its commit deletes
the entry in the same transaction (:class:`SettleInCommit`): an entry left behind is a
debit whose command did not commit, and reconciliation refunds it (an entry of an older
version whose command did commit is found claimed by the command log and dropped). A
debit of the embedded wallet commits with its command in one transaction and needs no
entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import sqlalchemy as sa

from roomservice.store import tables as t
from roomservice.store.database import Database, insert_or_ignore
from roomservice.store.port import Writes
from roomservice.store.writes import run_writes


@dataclass(frozen=True, slots=True)
class JournalEntry:
    debit_key: str
    app_code: str
    room_id: str
    command_id: str
    user_id: str
    amount: int
    created_at_ms: int


@dataclass(frozen=True, slots=True)
class SettleInCommit:
    """The gift's journal entry deleted by the gift's own commit (an
    :class:`~roomservice.store.port.AttachedWrite`): a committed gift leaves nothing to reconcile,
    so no later reading of the command log (pruned after ``room.idempotency_retention``) can take
    its debit for an orphan and refund it."""

    debit_key: str

    @property
    def lock_order(self) -> tuple[str, ...]:
        return ("~journal", self.debit_key)

    async def write(self, writes: Writes, *, shared: bool) -> None:
        await writes.execute_rendered(_FORGET, {"b_key": self.debit_key})  # never refused: fails nothing

    def committed(self) -> None:
        return None


class DebitJournal:
    """The room service's durable record of the debits it asked the wallet for."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def record(self, entry: JournalEntry) -> bool:
        """Journal a debit about to be asked for; a retry of the same command restarts its
        clock, so reconciliation never refunds a debit whose command is still being tried.
        True if the key was journaled already (an earlier attempt of the command, not settled).
        Once a gift, before its command's transaction: on the driver's cursor as that one
        (:mod:`roomservice.store.writes`)."""
        return await run_writes(self._db, _record, entry)

    async def forget(self, debit_key: str) -> None:
        await run_writes(self._db, _forget, debit_key)

    async def older_than(
        self, before_ms: int, *, limit: int, after: tuple[int, str] | None = None
    ) -> list[JournalEntry]:
        """Up to ``limit`` entries journaled before ``before_ms``, oldest first (then by key); ``after``:
        only those past that entry's (created_at_ms, debit_key), the next page."""
        d = t.wallet_pending_debit.c
        query = sa.select(t.wallet_pending_debit).where(d.created_at_ms < before_ms)
        if after is not None:
            at, key = after
            query = query.where((d.created_at_ms > at) | ((d.created_at_ms == at) & (d.debit_key > key)))
        async with self._db.read() as conn:
            rows = (await conn.execute(query.order_by(d.created_at_ms, d.debit_key).limit(limit))).all()
        return [
            JournalEntry(
                r.debit_key, r.app_code, r.room_id, r.command_id, r.user_id, int(r.amount), int(r.created_at_ms)
            )
            for r in rows
        ]


_TOUCH: Final = (
    sa.update(t.wallet_pending_debit)
    .where(t.wallet_pending_debit.c.debit_key == sa.bindparam("b_key"))
    .values(created_at_ms=sa.bindparam("b_now"))
)
_INSERT: Final = insert_or_ignore(t.wallet_pending_debit)


_FORGET: Final = sa.delete(t.wallet_pending_debit).where(t.wallet_pending_debit.c.debit_key == sa.bindparam("b_key"))


async def _record(writes: Writes, entry: JournalEntry) -> bool:
    if await writes.execute_rendered(_TOUCH, {"b_key": entry.debit_key, "b_now": entry.created_at_ms}) != 0:
        return True
    row = {
        "debit_key": entry.debit_key,
        "app_code": entry.app_code,
        "room_id": entry.room_id,
        "command_id": entry.command_id,
        "user_id": entry.user_id,
        "amount": entry.amount,
        "created_at_ms": entry.created_at_ms,
    }
    return await writes.execute_rendered(_INSERT, row) == 0  # ignored: another attempt journaled it meanwhile


async def _forget(writes: Writes, debit_key: str) -> None:
    await writes.execute_rendered(_FORGET, {"b_key": debit_key})
