"""The outbox repository port: the SQL the worker runs, in short transactions only.

Every finishing write is guarded by the claim (``status = 'delivering' AND
lock_owner = :owner``): a worker whose claim expired and was taken over
changes nothing. Adapters: :class:`roomservice.outbox.sql.SqlOutboxRepository`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from roomservice.outbox.model import ClaimedRow


@dataclass(frozen=True, slots=True)
class RetryDecision:
    """How to finish a row that did not reach all its targets."""

    row_id: int
    targets_done: str
    failed: bool  # True: dead letter (max_retry_count reached or permanent error)
    next_retry_at_ms: int
    last_error: str


class Delivered(NamedTuple):  # one per delivered row: a named tuple, cheap to build (see ClaimedRow)
    row_id: int
    targets_done: str


class OutboxRepository(Protocol):
    async def claim_due(
        self, *, owner: str, now_ms: int, lock_ms: int, limit: int, pending_only: bool = False
    ) -> list[ClaimedRow]:
        """Claim up to ``limit`` rows: pending, retryable due by ``now_ms``, delivering with an expired lock.

        One short transaction; claimed rows become ``delivering`` with ``lock_owner = owner``
        and ``lock_until_ms = now_ms + lock_ms``. Rows claimed by a live lock are never returned.
        ``pending_only`` is a hint for wake-up cycles (fresh commits): an adapter may then skip
        looking for due retryable and expired rows, which the next full claim picks up.
        """
        ...

    async def finish(self, *, owner: str, now_ms: int, delivered: list[Delivered], retries: list[RetryDecision]) -> int:
        """Finish rows in one transaction, each write guarded by the claim. Returns rows changed.

        A finished row's ``due_at_ms`` (the claim key) becomes the time it finished."""
        ...

    async def finish_and_claim(
        self,
        *,
        owner: str,
        now_ms: int,
        delivered: list[Delivered],
        retries: list[RetryDecision],
        lock_ms: int,
        limit: int,
        pending_only: bool = False,
    ) -> tuple[int, list[ClaimedRow]]:
        """:meth:`finish` then :meth:`claim_due` in ONE transaction: (rows finished, rows claimed).

        The worker's next claim rides on its previous finish: one transaction a batch under
        load instead of two. Both commit or neither does; none of the rows it finishes is
        claimed again by it, not even a retry already due (a finish decided a while ago, or
        without backoff): retryable and expired rows are claimed only if due before the
        earliest ``next_retry_at_ms`` written here. Claimed again by the same owner in the
        same transaction, a row would match the guard of this finish written again after a
        lost answer, and its failure would count twice.
        """
        ...

    async def extend(self, *, owner: str, row_ids: list[int], now_ms: int, lock_ms: int) -> int:
        """Extend the claims ``owner`` still holds among ``row_ids`` to ``now_ms + lock_ms``
        (a batch that runs long keeps its rows). Returns how many it still held."""
        ...

    async def release(self, *, owner: str, row_ids: list[int] | None, now_ms: int) -> int:
        """Hand unfinished claims back (graceful shutdown): delivering -> pending/retryable as before.
        ``row_ids`` None: every row ``owner`` still holds."""
        ...

    async def defer(self, *, owner: str, row_ids: list[int], now_ms: int) -> int:
        """Hand claimed, never-attempted rows back behind the rest of the queue (due now); their rooms'
        later pending rows go behind them too (due now, after them by id), so that a room's rows are
        still claimed in order. Returns the claimed rows handed back."""
        ...

    async def delete_delivered(self, *, before_ms: int, limit: int) -> int:
        """Delete up to ``limit`` delivered (or legacy published) rows delivered before ``before_ms``."""
        ...
