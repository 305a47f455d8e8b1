"""The in-process lease adapter: one process owns every room (the embedded mode)."""

from __future__ import annotations

import itertools
import time

from roomservice.leases.port import Lease, LeaseUnavailable


class InProcessLeases:
    """Leases for a single process: always granted, never expire, revocable for tests."""

    def __init__(self) -> None:
        self._tokens = itertools.count(1)
        self._holders: dict[tuple[str, str], str] = {}

    async def acquire(self, app_code: str, room_id: str) -> Lease:
        token = str(next(self._tokens))
        self._holders[(app_code, room_id)] = token
        return Lease(app_code, room_id, token, float("inf"))

    async def ensure(self, lease: Lease) -> Lease:
        if self._holders.get((lease.app_code, lease.room_id)) != lease.token:
            raise LeaseUnavailable(f"lease on {lease.app_code}/{lease.room_id} was lost")
        if lease.expires_at <= time.monotonic():
            raise LeaseUnavailable(f"lease on {lease.app_code}/{lease.room_id} expired")
        return lease

    async def release(self, lease: Lease) -> None:
        key = (lease.app_code, lease.room_id)
        if self._holders.get(key) == lease.token:
            del self._holders[key]

    def revoke(self, app_code: str, room_id: str) -> None:
        """Drop the holder, as if its lease expired (used by tests of fencing)."""
        self._holders.pop((app_code, room_id), None)
