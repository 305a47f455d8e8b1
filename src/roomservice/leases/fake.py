"""A controllable lease manager for tests: take a lease away on demand, hold a room elsewhere, count calls.

It behaves like a shared (Redis) lease: a room another holder owns is refused
with :class:`LeaseUnavailable` until that holder lets go, and a lease can be
lost behind its owner's back — expired (:meth:`FakeLeases.expire`), revoked
(:meth:`FakeLeases.revoke`) or taken over by another process
(:meth:`FakeLeases.steal`). Re-acquiring a room this manager already holds
supersedes the earlier lease, as the in-process adapter does.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, replace

from roomservice.leases.port import Lease, LeaseUnavailable

SELF = "self"


@dataclass(slots=True)
class _Holder:
    owner: str
    token: str
    expired: bool = False


class FakeLeases:
    """Leases in a dict, with switches: ``ttl_s`` (None: never expire), ``down`` (every call raises)."""

    def __init__(self, *, ttl_s: float | None = None) -> None:
        self.ttl_s = ttl_s
        self.down = False
        self.calls: Counter[str] = Counter()  # "acquire" / "ensure" / "release" -> number of calls
        self._tokens = itertools.count(1)
        self._holders: dict[tuple[str, str], _Holder] = {}

    # ---------------------------------------------------------------- the port

    async def acquire(self, app_code: str, room_id: str) -> Lease:
        self._enter("acquire")
        key = (app_code, room_id)
        holder = self._holders.get(key)
        if holder is not None and holder.owner != SELF and not holder.expired:
            raise LeaseUnavailable(f"{app_code}/{room_id} is held by {holder.owner}")
        return self._grant(key, SELF)

    async def ensure(self, lease: Lease) -> Lease:
        self._enter("ensure")
        holder = self._holders.get((lease.app_code, lease.room_id))
        if holder is None or holder.token != lease.token:
            raise LeaseUnavailable(f"lease on {lease.app_code}/{lease.room_id} was lost")
        if holder.expired or lease.expires_at <= time.monotonic():
            raise LeaseUnavailable(f"lease on {lease.app_code}/{lease.room_id} expired")
        if self.ttl_s is None:
            return lease
        return replace(lease, expires_at=time.monotonic() + self.ttl_s)  # renewed

    async def release(self, lease: Lease) -> None:
        self._enter("release")
        key = (lease.app_code, lease.room_id)
        holder = self._holders.get(key)
        if holder is not None and holder.token == lease.token:
            del self._holders[key]

    # ---------------------------------------------------------------- controls

    def expire(self, app_code: str, room_id: str) -> None:
        """The current lease on the room runs out (anyone may take the room now)."""
        holder = self._holders.get((app_code, room_id))
        if holder is not None:
            holder.expired = True

    def revoke(self, app_code: str, room_id: str) -> None:
        """Drop the room's holder, as an operator deleting the lease key would."""
        self._holders.pop((app_code, room_id), None)

    def steal(self, app_code: str, room_id: str, *, owner: str = "other-process") -> Lease:
        """Another process takes the room over (whoever held it); its lease is returned."""
        return self._grant((app_code, room_id), owner)

    def hold(self, app_code: str, room_id: str, *, owner: str = "other-process") -> Lease:
        """Another process holds the room: ``acquire`` is refused until it is released or expired."""
        return self.steal(app_code, room_id, owner=owner)

    def holder(self, app_code: str, room_id: str) -> str | None:
        """Who holds the room's live lease (``"self"`` for this manager), if anyone."""
        holder = self._holders.get((app_code, room_id))
        return None if holder is None or holder.expired else holder.owner

    # ---------------------------------------------------------------- internals

    def _enter(self, call: str) -> None:
        self.calls[call] += 1
        if self.down:
            raise LeaseUnavailable("lease backend is down")

    def _grant(self, key: tuple[str, str], owner: str) -> Lease:
        token = f"fake-{next(self._tokens)}"
        self._holders[key] = _Holder(owner, token)
        expires_at = float("inf") if self.ttl_s is None else time.monotonic() + self.ttl_s
        return Lease(key[0], key[1], token, expires_at)
