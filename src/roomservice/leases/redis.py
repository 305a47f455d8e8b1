"""Room leases in Redis: one owner per room across processes, renewed well before expiry.

A lease is the key ``<prefix>lease:<app>:<room>`` whose value names its holder:
``{"token": ..., "owner": ..., "address": "host:port"}`` (the address is where
other processes forward the room's commands). Taking it is ``SET NX PX ttl``
(inside a script that also lets this same manager supersede a lease of its own
that a failed release left behind); renewal (``PEXPIRE``) and release (``DEL``)
compare the token atomically in Lua, so a holder never extends or deletes a
lease someone else took over.

Safety rule: a holder stops serving a room *before* its lease could have
expired anywhere. Every lease carries a local deadline, ``expires_at``, measured
on this process's monotonic clock from the moment the last confirmed
acquire/renewal request was *sent* (Redis starts its TTL later than that), minus
``safety_margin``. Past it, :meth:`RedisLeases.ensure` raises
:class:`LeaseUnavailable` and the lease is dead for good, even if Redis answers
again. Taking a lease also bumps the room's durable fencing epoch
(``CellRegistry._load``), so a former holder that was paused between its check
and its commit cannot commit either.

Renewal: :meth:`RedisLeases.run_renewal` renews every held lease
``renew_every`` after its last confirmation and, when a lease is lost (token
gone or replaced, or its deadline passed without a confirmed renewal), calls
``on_lost(app_code, room_id)`` so the owner evicts the cell. ``ensure`` renews a
lease itself if the loop has not yet (single-flight with it).

Redis down: every call is bounded (``socket_connect_timeout + socket_timeout``)
and fails with :class:`LeaseBackendUnavailable` (``503 unavailable``). A lease
past its renewal point whose renewal cannot be confirmed fails ``ensure`` that
way, its cell is kept, and the same manager carries on once Redis answers (the
connection pool reconnects by itself) — unless the deadline passed meanwhile.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from roomservice.leases.port import Lease, LeaseBackendUnavailable, LeaseOwner, LeaseUnavailable
from roomservice.observability.logging import get_logger

if TYPE_CHECKING:
    from roomservice.config import LeaseConfig, RedisConfig

_log = get_logger("roomservice.leases")

T = TypeVar("T")

# Take the key unless someone else holds it. ARGV: value, owner, ttl_ms. Returns nil when
# granted, else the holder's value. A leftover lease of this same owner (its release failed)
# is superseded: only this manager could have written it, and it no longer uses it.
ACQUIRE_LUA: Final = """
local current = redis.call('GET', KEYS[1])
if current then
  local ok, held = pcall(cjson.decode, current)
  if not (ok and type(held) == 'table' and held['owner'] == ARGV[2]) then
    return current
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return false
"""

# Extend the key's TTL iff it still holds the token. ARGV: token, ttl_ms. Returns 1 / 0.
RENEW_LUA: Final = """
local current = redis.call('GET', KEYS[1])
if not current then return 0 end
local ok, held = pcall(cjson.decode, current)
if ok and type(held) == 'table' and held['token'] == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# Delete the key iff it still holds the token. ARGV: token. Returns 1 / 0.
RELEASE_LUA: Final = """
local current = redis.call('GET', KEYS[1])
if not current then return 0 end
local ok, held = pcall(cjson.decode, current)
if ok and type(held) == 'table' and held['token'] == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

RENEW_CONCURRENCY: Final = 16

OnLost = Callable[[str, str], "Awaitable[None] | None"]


def default_owner() -> str:
    """A process identity unique across restarts: ``host:pid:random``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def redis_client(config: RedisConfig) -> aioredis.Redis:
    """A client with bounded calls: one reconnect attempt, no backoff, the configured socket timeouts.

    The pool reconnects by itself after Redis comes back; a call on a connection
    Redis dropped is retried once on a fresh one.
    """
    return aioredis.Redis.from_url(
        config.connect_url(),
        decode_responses=True,
        socket_timeout=config.socket_timeout.total_seconds(),
        socket_connect_timeout=config.socket_connect_timeout.total_seconds(),
        retry=Retry(NoBackoff(), 1),
        health_check_interval=0,
    )


def call_bound_s(config: RedisConfig) -> float:
    """The bound of one Redis call: connecting plus reading the reply."""
    return config.socket_connect_timeout.total_seconds() + config.socket_timeout.total_seconds()


async def bounded(call: Awaitable[T], *, timeout_s: float, what: str) -> T:
    """Run one Redis call within ``timeout_s``; any Redis failure becomes :class:`LeaseBackendUnavailable`."""
    try:
        async with asyncio.timeout(timeout_s):
            return await call
    except (RedisError, OSError, TimeoutError) as exc:
        raise LeaseBackendUnavailable(f"redis unavailable ({what}): {exc.__class__.__name__}") from exc


@dataclass(slots=True)
class _Held:
    lease: Lease  # the current one: expires_at is the safe local deadline
    confirmed_at: float  # when the last confirmed acquire/renewal was sent (monotonic)
    next_attempt: float  # when the renewal loop renews it next
    renewing: asyncio.Task[None] | None = None


class RedisLeases:
    """The lease port over Redis (see the module docstring). Durations are seconds."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        address: str,
        ttl_s: float,
        renew_every_s: float,
        safety_margin_s: float,
        call_timeout_s: float,
        key_prefix: str = "roomservice:",
        owner: str | None = None,
        on_lost: OnLost | None = None,
        clock: Callable[[], float] = time.monotonic,
        owns_client: bool = False,
    ) -> None:
        if not 0 < safety_margin_s < ttl_s:
            raise ValueError("safety_margin_s must be in (0, ttl_s)")
        if not 0 < renew_every_s < ttl_s - safety_margin_s:
            raise ValueError("renew_every_s must be in (0, ttl_s - safety_margin_s)")
        self.client = client
        self.owner = owner or default_owner()
        self.address = address
        self.ttl_s = ttl_s
        self.renew_every_s = renew_every_s
        self.safety_margin_s = safety_margin_s
        self.call_timeout_s = call_timeout_s
        self.key_prefix = key_prefix
        self.on_lost = on_lost  # set by whoever owns the cells (it evicts the room's cell)
        self.clock = clock
        self._owns_client = owns_client
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._retry_after_s = min(renew_every_s, safety_margin_s) / 2
        self._held: dict[tuple[str, str], _Held] = {}
        self._wake = asyncio.Event()
        self._acquire = client.register_script(ACQUIRE_LUA)
        self._renew = client.register_script(RENEW_LUA)
        self._release = client.register_script(RELEASE_LUA)

    @classmethod
    def from_config(
        cls,
        redis: RedisConfig,
        lease: LeaseConfig,
        *,
        address: str,
        owner: str | None = None,
        on_lost: OnLost | None = None,
    ) -> RedisLeases:
        """A manager with its own client (closed by :meth:`aclose`)."""
        return cls(
            redis_client(redis),
            address=address,
            owner=owner,
            on_lost=on_lost,
            ttl_s=lease.ttl.total_seconds(),
            renew_every_s=lease.renew_every.total_seconds(),
            safety_margin_s=lease.safety_margin.total_seconds(),
            call_timeout_s=call_bound_s(redis),
            key_prefix=redis.key_prefix,
            owns_client=True,
        )

    def key(self, app_code: str, room_id: str) -> str:
        return f"{self.key_prefix}lease:{app_code}:{room_id}"

    def held(self) -> list[Lease]:
        """The leases this manager holds (and renews) now."""
        return [h.lease for h in self._held.values()]

    # ---------------------------------------------------------------- the port

    async def acquire(self, app_code: str, room_id: str) -> Lease:
        token = uuid.uuid4().hex
        value = json.dumps({"token": token, "owner": self.owner, "address": self.address}, separators=(",", ":"))
        sent_at = self.clock()
        holder = await self._call(
            self._acquire(keys=[self.key(app_code, room_id)], args=[value, self.owner, self._ttl_ms]), "acquire"
        )
        if holder is not None:
            raise LeaseUnavailable(f"{app_code}/{room_id} is held by {_describe(holder)}")
        lease = Lease(app_code, room_id, token, self._deadline(sent_at))
        self._held[(app_code, room_id)] = _Held(lease, sent_at, sent_at + self.renew_every_s)
        self._wake.set()
        return lease

    async def ensure(self, lease: Lease) -> Lease:
        key = (lease.app_code, lease.room_id)
        held = self._held.get(key)
        if held is None or held.lease.token != lease.token:
            return await self._confirm_untracked(lease)
        if self.clock() >= held.lease.expires_at:
            self._drop(key, held)
            raise LeaseUnavailable(f"lease on {lease.app_code}/{lease.room_id} could have expired")
        if self.clock() < held.confirmed_at + self.renew_every_s:
            return held.lease
        await self._renew_held(key, held)
        return held.lease

    async def release(self, lease: Lease) -> None:
        """Give the lease up; best effort: if Redis does not answer, the key expires by itself."""
        key = (lease.app_code, lease.room_id)
        held = self._held.get(key)
        if held is not None and held.lease.token == lease.token:
            self._drop(key, held)
        try:
            await self._call(self._release(keys=[self.key(*key)], args=[lease.token]), "release")
        except LeaseBackendUnavailable as exc:
            _log.warning("lease_release_failed", app_code=lease.app_code, room_id=lease.room_id, error=str(exc))

    # ---------------------------------------------------------------- forwarding

    async def owner_of(self, app_code: str, room_id: str) -> LeaseOwner | None:
        """Who holds the room's lease now (None: nobody), as its value names it."""
        raw = await self._call(self.client.get(self.key(app_code, room_id)), "owner_of")
        if raw is None:
            return None
        return _parse_owner(raw if isinstance(raw, str) else raw.decode())

    # ---------------------------------------------------------------- renewal loop

    async def run_renewal(self) -> None:
        """Renew held leases until cancelled; report lost ones to ``on_lost``."""
        limit = asyncio.Semaphore(RENEW_CONCURRENCY)
        while True:
            self._wake.clear()
            now = self.clock()
            due = [(key, held) for key, held in self._held.items() if now >= held.next_attempt]
            if due:
                await asyncio.gather(*(self._renew_in_loop(key, held, limit) for key, held in due))
            next_at = min((h.next_attempt for h in self._held.values()), default=None)
            timeout = None if next_at is None else max(0.0, next_at - self.clock())
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def aclose(self) -> None:
        """Close the client if this manager created it (leases are not released: their cells do that)."""
        if self._owns_client:
            await self.client.aclose()

    # ---------------------------------------------------------------- internals

    def _deadline(self, sent_at: float) -> float:
        return sent_at + self.ttl_s - self.safety_margin_s

    async def _call(self, call: Awaitable[T], what: str) -> T:
        return await bounded(call, timeout_s=self.call_timeout_s, what=what)

    def _drop(self, key: tuple[str, str], held: _Held) -> None:
        if self._held.get(key) is held:
            del self._held[key]

    async def _confirm_untracked(self, lease: Lease) -> Lease:
        """A lease this manager does not hold (released, superseded, or someone else's): ask Redis."""
        if self.clock() >= lease.expires_at:
            raise LeaseUnavailable(f"lease on {lease.app_code}/{lease.room_id} could have expired")
        sent_at = self.clock()
        renewed = await self._call(
            self._renew(keys=[self.key(lease.app_code, lease.room_id)], args=[lease.token, self._ttl_ms]), "renew"
        )
        if not renewed:
            raise LeaseUnavailable(f"lease on {lease.app_code}/{lease.room_id} was lost")
        return replace(lease, expires_at=self._deadline(sent_at))

    async def _renew_held(self, key: tuple[str, str], held: _Held) -> None:
        """Renew ``held``, sharing a renewal already under way (a task: a caller that is
        cancelled does not cancel it for the others). Raises LeaseUnavailable if the lease is
        lost (and forgets it), LeaseBackendUnavailable if Redis does not confirm in time."""
        task = held.renewing
        if task is None:
            task = held.renewing = asyncio.get_running_loop().create_task(self._renew_once(key, held))
            task.add_done_callback(lambda done: _clear_renewing(held, done))
        await asyncio.shield(task)

    async def _renew_once(self, key: tuple[str, str], held: _Held) -> None:
        app_code, room_id = key
        if self.clock() >= held.lease.expires_at:
            self._drop(key, held)
            raise LeaseUnavailable(f"lease on {app_code}/{room_id} could have expired")
        sent_at = self.clock()
        try:
            # no longer than the lease has left: a renewal Redis does not confirm by the deadline
            # reports the lease lost at the deadline, not a call bound later
            renewed = await bounded(
                self._renew(keys=[self.key(app_code, room_id)], args=[held.lease.token, self._ttl_ms]),
                timeout_s=max(0.0, min(self.call_timeout_s, held.lease.expires_at - sent_at)),
                what="renew",
            )
        except LeaseBackendUnavailable:
            now = self.clock()
            if now >= held.lease.expires_at:
                self._drop(key, held)
                raise LeaseUnavailable(
                    f"lease on {app_code}/{room_id} could have expired: redis did not confirm its renewal"
                ) from None
            held.next_attempt = min(now + self._retry_after_s, held.lease.expires_at)
            raise
        if not renewed:
            self._drop(key, held)
            raise LeaseUnavailable(f"lease on {app_code}/{room_id} was lost (taken over, or expired in redis)")
        held.confirmed_at = sent_at
        held.next_attempt = sent_at + self.renew_every_s
        held.lease = replace(held.lease, expires_at=self._deadline(sent_at))

    async def _renew_in_loop(self, key: tuple[str, str], held: _Held, limit: asyncio.Semaphore) -> None:
        async with limit:
            if self._held.get(key) is not held:  # released or superseded meanwhile
                return
            try:
                await self._renew_held(key, held)
            except LeaseBackendUnavailable as exc:
                _log.warning("lease_renewal_failed", app_code=key[0], room_id=key[1], error=str(exc))
            except LeaseUnavailable as exc:
                _log.warning("lease_lost", app_code=key[0], room_id=key[1], reason=str(exc))
                await self._report_lost(key)

    async def _report_lost(self, key: tuple[str, str]) -> None:
        if self.on_lost is None or key in self._held:  # already taken again: the room's cell is fresh
            return
        try:
            result = self.on_lost(*key)
            if inspect.isawaitable(result):
                await result
        except Exception:
            _log.exception("lease_on_lost_failed", app_code=key[0], room_id=key[1])


def _clear_renewing(held: _Held, done: asyncio.Task[None]) -> None:
    if held.renewing is done:
        held.renewing = None
    if not done.cancelled():
        done.exception()  # retrieved: every awaiting caller re-raises it itself


def _parse_owner(raw: str) -> LeaseOwner:
    try:
        value = json.loads(raw)
        return LeaseOwner(owner=str(value["owner"]), address=str(value["address"]), token=str(value["token"]))
    except (ValueError, TypeError, KeyError):
        return LeaseOwner(owner=raw, address="", token="")  # not written by this service


def _describe(raw: str) -> str:
    owner = _parse_owner(raw)
    return f"{owner.owner} at {owner.address}" if owner.address else owner.owner
