"""The lease port: who owns a room's cell right now.

A lease alone is not enough to stop a paused process from writing after it
lost ownership, so every lease comes with a fencing epoch that the store bumps
durably when the lease is taken (``RoomStore.take_lease_epoch``) and that
SaveMutation checks. This module holds the port and the in-process adapter for
the embedded mode; the Redis adapter implements the same port.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Protocol


class LeaseUnavailable(Exception):
    """Another process holds the room's lease; the command answers ``503 retry``."""


@dataclass(frozen=True, slots=True)
class Lease:
    app_code: str
    room_id: str
    token: str
    expires_at: float  # time.monotonic() deadline; inf for leases that never expire


class LeaseManager(Protocol):
    async def acquire(self, app_code: str, room_id: str) -> Lease:
        """Take the room's lease or raise :class:`LeaseUnavailable`."""
        ...

    async def ensure(self, lease: Lease) -> Lease:
        """Return ``lease`` (renewed if close to expiry) or raise LeaseUnavailable if it was lost."""
        ...

    async def release(self, lease: Lease) -> None:
        """Give the lease up (best effort)."""
        ...


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
