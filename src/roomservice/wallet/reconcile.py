"""Reconciliation of gift debits that no committed command claims.

Before a gift's debit by an external wallet (``wallet.driver: http``) the service
journals the key (``wallet_pending_debit``). A debit whose command never committed —
the wallet timed out, the process crashed, the version race was lost and the client
gave up — is refunded once ``reconcile_after`` has passed; a debit that a committed
command claims simply leaves the journal. The embedded wallet's debit is written in
the command's own transaction (:mod:`roomservice.wallet.embedded`): it cannot outlive
an uncommitted command, so it is not journaled.

An entry is reconciled holding its room's turn, so every process whose command pipeline
can hold rooms runs a reconciler (``bootstrap.commands``): on Redis leases the process
holding a busy room reconciles its entries, the others count them ``held_elsewhere``
and go on; a room nobody holds is taken by whichever reconciler comes first.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

from roomservice.domain.commands import SendGift
from roomservice.errors import Retry, Unavailable
from roomservice.leases.port import LeaseUnavailable
from roomservice.observability.logging import get_logger
from roomservice.store.port import RoomStore
from roomservice.wallet.journal import DebitJournal, JournalEntry
from roomservice.wallet.port import Wallet, WalletError

_log = get_logger("roomservice.wallet")


RoomTurn = Callable[[str, str], AbstractAsyncContextManager[None]]


@asynccontextmanager
async def _no_turn(app_code: str, room_id: str) -> AsyncIterator[None]:
    yield


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    checked: int = 0
    claimed: int = 0
    refunded: int = 0
    errors: int = 0
    held_elsewhere: int = 0  # the room's lease is another process's: its own reconciler takes the entry

    def __add__(self, other: ReconcileReport) -> ReconcileReport:
        return ReconcileReport(
            self.checked + other.checked,
            self.claimed + other.claimed,
            self.refunded + other.refunded,
            self.errors + other.errors,
            self.held_elsewhere + other.held_elsewhere,
        )


class Reconciler:
    def __init__(
        self,
        *,
        journal: DebitJournal,
        wallet: Wallet,
        store: RoomStore,
        reconcile_after_ms: int,
        clock: Callable[[], int],
        batch_size: int = 200,
        room_turn: RoomTurn = _no_turn,
    ) -> None:
        """``room_turn(app, room)`` holds the room as a command does (the cell registry's
        ``holding``): a gift retried at the same moment either commits before the check
        (claimed) or runs after the refund (and charges again, once)."""
        self._journal = journal
        self._wallet = wallet
        self._store = store
        self._after_ms = reconcile_after_ms
        self._clock = clock
        self._batch_size = batch_size
        self._room_turn = room_turn

    async def run_once(self) -> ReconcileReport:
        """One pass over every entry old enough, a page at a time: an entry that fails (its room held
        elsewhere, the wallet refusing) stays for the next pass, and the pages go on past it, so entries
        that keep failing never hold up the ones behind them."""
        before_ms = self._clock() - self._after_ms
        report = ReconcileReport()
        after: tuple[int, str] | None = None
        while True:
            entries = await self._journal.older_than(before_ms, limit=self._batch_size, after=after)
            report += await self._reconcile(entries)
            if len(entries) < self._batch_size:
                return report
            after = (entries[-1].created_at_ms, entries[-1].debit_key)

    async def _reconcile(self, entries: list[JournalEntry]) -> ReconcileReport:
        claimed = refunded = errors = elsewhere = 0
        for entry in entries:
            try:
                async with self._room_turn(entry.app_code, entry.room_id):
                    logged = await self._store.find_command(entry.app_code, entry.room_id, entry.command_id)
                    # the gift itself committed; not another command a client sent under its id after the
                    # gift's outcome was unknown (that one paid nothing: the debit is refunded)
                    if logged is not None and logged.command_type in (None, SendGift.name):
                        claimed += 1
                    else:
                        debit = await self._wallet.refund(entry.debit_key)
                        if debit is not None:
                            refunded += 1
                            _log.warning(
                                "wallet_debit_refunded",
                                debit_key=entry.debit_key,
                                user_id=entry.user_id,
                                amount=entry.amount,
                            )
                    await self._journal.forget(entry.debit_key)
            except LeaseUnavailable:  # another process holds the room: it reconciles the entry itself
                elsewhere += 1
                _log.debug("wallet_reconcile_held_elsewhere", debit_key=entry.debit_key, room_id=entry.room_id)
            except (WalletError, Unavailable, Retry, TimeoutError) as exc:  # next pass
                errors += 1
                _log.warning("wallet_reconcile_failed", debit_key=entry.debit_key, error=str(exc))
            except Exception:  # a room that does not load (StoreInconsistent), a bug: this entry alone waits
                errors += 1
                _log.exception("wallet_reconcile_failed", debit_key=entry.debit_key, room_id=entry.room_id)
        return ReconcileReport(len(entries), claimed, refunded, errors, elsewhere)

    async def run(self, *, interval_s: float) -> None:
        while True:
            try:
                await self.run_once()
            except Exception:
                _log.exception("wallet_reconcile_pass_failed")
            await asyncio.sleep(interval_s)
