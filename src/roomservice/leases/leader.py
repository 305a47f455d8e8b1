"""The maintenance leader in Redis: one process at a time runs a named maintenance job.

A :class:`~roomservice.leases.maintenance.MaintenanceLock` for deployments with
Redis (``lease.driver: redis``); without Redis the database lock
(:class:`~roomservice.leases.maintenance.DatabaseMaintenanceLock`) elects the
leader instead. The lock is the key ``<prefix>maintenance:<name>`` taken with
``SET NX PX ttl`` and renewed in the background while held (compare-token-and-
PEXPIRE), so a crashed holder frees it within ``ttl``; release compares the
token too, so a holder that lost the key never deletes someone else's.

A job that runs while its lock was lost (Redis lost the key, or the holder was
paused past ``ttl``) keeps going until its next check: maintenance jobs are
batched and idempotent, so two at once only waste work. :meth:`held` says
whether the lock is still this process's, for a job that wants to stop early.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING

import redis.asyncio as aioredis

from roomservice.leases.port import LeaseBackendUnavailable
from roomservice.leases.redis import RELEASE_LUA, RENEW_LUA, bounded, call_bound_s, default_owner, redis_client
from roomservice.observability.logging import get_logger

if TYPE_CHECKING:
    from roomservice.config import LeaseConfig, RedisConfig

_log = get_logger("roomservice.leases")


class RedisMaintenanceLock:
    """A named, non-blocking, non-reentrant lock across processes, in Redis. Durations are seconds."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        ttl_s: float,
        renew_every_s: float,
        call_timeout_s: float,
        key_prefix: str = "roomservice:",
        owner: str | None = None,
        owns_client: bool = False,
    ) -> None:
        if not 0 < renew_every_s < ttl_s:
            raise ValueError("renew_every_s must be in (0, ttl_s)")
        self.client = client
        self.owner = owner or default_owner()
        self.ttl_s = ttl_s
        self.renew_every_s = renew_every_s
        self.call_timeout_s = call_timeout_s
        self.key_prefix = key_prefix
        self._owns_client = owns_client
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._tokens: dict[str, str] = {}
        self._renewals: dict[str, asyncio.Task[None]] = {}
        self._renew = client.register_script(RENEW_LUA)
        self._release = client.register_script(RELEASE_LUA)

    @classmethod
    def from_config(cls, redis: RedisConfig, lease: LeaseConfig, *, owner: str | None = None) -> RedisMaintenanceLock:
        """A lock with its own client (closed by :meth:`aclose`), timed like the room leases."""
        return cls(
            redis_client(redis),
            ttl_s=lease.ttl.total_seconds(),
            renew_every_s=lease.renew_every.total_seconds(),
            call_timeout_s=call_bound_s(redis),
            key_prefix=redis.key_prefix,
            owner=owner,
            owns_client=True,
        )

    def key(self, name: str) -> str:
        return f"{self.key_prefix}maintenance:{name}"

    def held(self, name: str) -> bool:
        """Whether this object holds ``name`` (as far as its last renewal knows)."""
        return name in self._tokens

    async def try_acquire(self, name: str) -> bool:
        """Take ``name`` unless anyone (this object included) holds it; raises
        :class:`LeaseBackendUnavailable` when Redis does not answer in time."""
        if name in self._tokens:
            return False
        token = uuid.uuid4().hex
        value = json.dumps({"token": token, "owner": self.owner, "since": time.time()}, separators=(",", ":"))
        sent_at = time.monotonic()
        got = await bounded(
            self.client.set(self.key(name), value, nx=True, px=self._ttl_ms),
            timeout_s=self.call_timeout_s,
            what="maintenance acquire",
        )
        if not got:
            return False
        self._tokens[name] = token
        self._renewals[name] = asyncio.get_running_loop().create_task(
            self._keep(name, token, sent_at), name=f"maintenance-lock-renewal:{name}"
        )
        return True

    async def release(self, name: str) -> None:
        """Give ``name`` back; a no-op unless this object holds it; best effort (the key expires anyway)."""
        token = self._tokens.pop(name, None)
        task = self._renewals.pop(name, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if token is None:
            return
        try:
            await bounded(
                self._release(keys=[self.key(name)], args=[token]),
                timeout_s=self.call_timeout_s,
                what="maintenance release",
            )
        except LeaseBackendUnavailable as exc:
            _log.warning("maintenance_lock_release_failed", name=name, error=str(exc))

    async def aclose(self) -> None:
        """Release every held lock; close the client if this object created it."""
        for name in list(self._tokens):
            await self.release(name)
        if self._owns_client:
            await self.client.aclose()

    async def _keep(self, name: str, token: str, confirmed_at: float) -> None:
        """Renew the key every ``renew_every_s`` while held; forget it once another token holds
        it, or once ``ttl`` passed without a confirmed renewal (it may have expired)."""
        while True:
            await asyncio.sleep(self.renew_every_s)
            sent_at = time.monotonic()
            try:
                renewed = await bounded(
                    self._renew(keys=[self.key(name)], args=[token, self._ttl_ms]),
                    timeout_s=self.call_timeout_s,
                    what="maintenance renew",
                )
            except LeaseBackendUnavailable as exc:
                _log.warning("maintenance_lock_renewal_failed", name=name, error=str(exc))
                if time.monotonic() - confirmed_at < self.ttl_s:
                    continue
                renewed = False
            if not renewed:
                _log.warning("maintenance_lock_lost", name=name)
                if self._tokens.get(name) == token:
                    del self._tokens[name]
                    self._renewals.pop(name, None)
                return
            confirmed_at = sent_at
