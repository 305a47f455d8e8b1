"""Client-side rate limit: one token bucket per API, waiting (not failing) within a deadline.

Tencent IM throttles each REST API at about 200 requests/second per app and answers
60007 beyond that. Each bucket refills at ``rate`` tokens per second up to ``burst``;
a request takes one token, or reserves the next one and sleeps until it is due. Waiters
are served in arrival order (reservations push the balance below zero). A request that
would have to wait past its deadline takes nothing and fails at once with
:class:`RateLimitExceeded`.

The default burst is a tenth of a second's worth of requests, so any one-second window
sees at most ``1.1 × rate`` requests from one process: configure the rate a little under
the quota, and remember several processes share it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

__all__ = ["RateLimitExceeded", "RateLimiter", "TokenBucket"]


class RateLimitExceeded(Exception):
    """The next token comes later than the deadline allows."""

    def __init__(self, key: str, wait_s: float) -> None:
        super().__init__(f"rate limit for {key!r}: the next slot is {wait_s:.3f}s away, past the deadline")
        self.key = key
        self.wait_s = wait_s


class TokenBucket:
    def __init__(self, rate: float, burst: float, *, now: float) -> None:
        if rate <= 0:
            raise ValueError("rate must be > 0")
        if burst < 1:
            raise ValueError("burst must be >= 1")
        self.rate = float(rate)
        self.burst = float(burst)
        self._tokens = self.burst
        self._updated = now

    def _refill(self, now: float) -> None:
        if now > self._updated:
            self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.rate)
            self._updated = now

    def tokens(self, now: float) -> float:
        self._refill(now)
        return self._tokens

    def reserve(self, now: float, *, latest: float | None = None) -> float | None:
        """Take one token; return how long to wait before using it (0.0: now), or ``None``
        (taking nothing) when that wait would end after ``latest``."""
        self._refill(now)
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        wait = (1 - self._tokens) / self.rate
        if latest is not None and now + wait > latest:
            return None
        self._tokens -= 1
        return wait

    def refund(self) -> None:
        """Give back a reserved token that was not used (the waiter was cancelled)."""
        self._tokens = min(self.burst, self._tokens + 1)


class RateLimiter:
    """Token buckets by key (the API's ``service/command``)."""

    def __init__(
        self,
        rate_per_second: float,
        *,
        burst: float | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if rate_per_second <= 0:
            raise ValueError("rate_per_second must be > 0")
        self.rate = float(rate_per_second)
        self.burst = float(burst) if burst is not None else float(max(1, math.ceil(self.rate / 10)))
        self._clock = clock
        self._sleep = sleep
        self._buckets: dict[str, TokenBucket] = {}

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    def bucket(self, key: str) -> TokenBucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, now=self._now())
        return bucket

    async def acquire(self, key: str, *, deadline: float | None = None) -> float:
        """Wait for a slot of ``key``; ``deadline`` is on this limiter's clock (by default
        the event loop's). Returns the time waited; raises :class:`RateLimitExceeded`."""
        bucket = self.bucket(key)
        now = self._now()
        wait = bucket.reserve(now, latest=deadline)
        if wait is None:
            raise RateLimitExceeded(key, (1 - bucket.tokens(now)) / bucket.rate)
        if wait > 0:
            try:
                await self._sleep(wait)
            except asyncio.CancelledError:
                bucket.refund()
                raise
        return wait
