"""The retry policy of the outbox worker: exponential backoff with a cap and jitter, validated."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``retry_count`` counts failed attempts; after the n-th failure the row waits
    ``min(max_backoff, initial_backoff * 2**(n-1))`` ± ``jitter``, and becomes a dead
    letter once ``retry_count >= max_retry_count``.
    """

    initial_backoff_ms: int
    max_backoff_ms: int
    max_retry_count: int
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.initial_backoff_ms <= 0:
            raise ValueError("initial_backoff must be > 0")
        if self.max_backoff_ms < self.initial_backoff_ms:
            raise ValueError("max_backoff must be >= initial_backoff")
        if self.max_retry_count < 0:
            raise ValueError("max_retry_count must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("jitter must be within 0..1")

    def base_backoff_ms(self, retry_count: int) -> int:
        """The backoff after the ``retry_count``-th failure, before jitter."""
        exponent = max(0, retry_count - 1)
        if exponent >= 62:  # beyond any cap; avoid building huge integers
            return self.max_backoff_ms
        return min(self.max_backoff_ms, self.initial_backoff_ms * (1 << exponent))

    def backoff_ms(self, retry_count: int, *, rng: random.Random | None = None) -> int:
        """The backoff with jitter, never above ``max_backoff`` and never below 1 ms."""
        base = self.base_backoff_ms(retry_count)
        if self.jitter == 0.0:
            return base
        spread = base * self.jitter
        delay = base + (rng or random).uniform(-spread, spread)
        return max(1, min(self.max_backoff_ms, round(delay)))

    def exhausted(self, retry_count: int) -> bool:
        """True when a row that has failed ``retry_count`` times becomes a dead letter."""
        return retry_count >= self.max_retry_count
