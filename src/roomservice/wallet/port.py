"""The wallet port: debit once per key, look a debit up, refund it.

Errors say whether they are definitive: :class:`InsufficientFunds` and
:class:`DebitKeyConflict` are answers; :class:`WalletUnavailable` (and a
timeout) are ambiguous — the debit may or may not have happened, which is why
the room service keeps a journal of debits it asked for and reconciles it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from roomservice import errors
from roomservice.store.port import AttachedWrite


class WalletError(errors.RoomServiceError):
    code = "wallet_error"


class InsufficientFunds(WalletError):
    """The balance does not cover the amount; nothing was debited."""


class DebitKeyConflict(WalletError):
    """The key was used for a different user or amount, or (``reused``) by a command committed
    long ago whose command_id is being used again; nothing was debited."""

    def __init__(self, key: str, *, reused: bool = False) -> None:
        super().__init__(key)
        self.key = key
        self.reused = reused


class WalletUnavailable(errors.Unavailable):
    """The wallet is down or did not answer in time; the debit may have happened."""


DEBITED = "debited"
REFUNDED = "refunded"


@dataclass(frozen=True, slots=True)
class Debit:
    key: str
    app_code: str
    user_id: str
    amount: int
    status: str  # debited | refunded
    # whether this call moved money: False when the key's existing debit was answered (a retry's).
    # A wallet that cannot tell says True (the service then cannot catch a command_id used again).
    charged: bool = True


def debit_key(app_code: str, room_id: str, command_id: str) -> str:
    """The idempotency key of a gift's debit: a retry of the command reuses it."""
    return f"room-gift:{app_code}:{room_id}:{command_id}"


class Wallet(Protocol):
    async def debit(self, *, key: str, app_code: str, user_id: str, amount: int) -> Debit:
        """Debit ``amount`` once per ``key``; repeating the same call returns the same debit
        (``charged`` False; a key refunded before is charged again, ``charged`` True)."""
        ...

    async def lookup(self, key: str) -> Debit | None:
        """The debit made under ``key``, if any."""
        ...

    async def refund(self, key: str) -> Debit | None:
        """Give a debit back (idempotent); None if no debit exists under ``key``."""
        ...

    async def balance(self, app_code: str, user_id: str) -> int: ...


class CommitWallet(Protocol):
    """A wallet whose ledger is in the store's own database (the embedded wallet): a gift's
    debit is written in the command's SaveMutation transaction, so it commits with the
    command or not at all, and a reused command_id is caught by the command log's unique key
    in that same transaction (nothing to journal, nothing to look up first)."""

    async def debit_in_commit(self, *, key: str, app_code: str, user_id: str, amount: int) -> AttachedWrite:
        """The debit as a write of the mutation; its failures (:class:`InsufficientFunds`,
        :class:`DebitKeyConflict`) are raised by ``save_mutation``, with nothing written."""
        ...
