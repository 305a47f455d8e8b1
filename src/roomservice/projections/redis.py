"""``RedisProjections``: the projections port on Redis, shared by every process.

Keys (``P`` = ``redis.key_prefix``; ``{app}`` is a hash tag, so one app's keys
share a cluster slot and one script may touch them all):

* ``P rooms:{app}`` — sorted set, the open rooms. Score ``-member_count``;
  member ``<19 digits: MAX - heat><room_id>\\n<entry JSON>``. ``ZRANGE 0 n-1``
  is therefore most members first, then most heat, then room_id — the order of
  :class:`InProcessProjections` — and carries the entries themselves.
* ``P room:{app}:<room_id>`` — hash: ``v`` the version the room's keys show,
  ``z`` its current sorted-set member, ``mk`` "1" when ``members`` is known.
  A closed room keeps ``v`` alone (a tombstone that expires after a day), so a
  late update of an older version cannot bring it back.
* ``P members:{app}:<room_id>`` — set, the members the presence hash credits to the room.
* ``P presence:{app}`` — hash, user_id -> room_id; ``P joined:{app}`` — hash, user_id -> when they
  joined that room (ms). A user who is a member of several rooms is present in the one joined last,
  whatever order the updates (or a rebuild) arrive in.
* ``P projections:built`` — the marker: set after a rebuild from the database.
  Redis without it has lost (or never had) the projections.

Every write is one Lua script that applies only if the stored version is older
than the change's, so a late or reordered update (a fenced-off former owner, a
retry) never overwrites a newer one. A change is sent as a diff of members when
Redis holds exactly the version before it, and with the whole member list
otherwise (an update was lost, Redis was emptied, the entry came from a seed).

Failures raise :class:`ProjectionsUnavailable` (an ``unavailable``): after a
commit the pipeline logs it and goes on; a read answers ``503``. Each call is
bounded by the client's socket timeouts and an outer deadline.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Final

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from roomservice import errors
from roomservice.domain.state import CLOSED, RoomState
from roomservice.observability.logging import get_logger
from roomservice.projections.loader import Loader, RebuildItem
from roomservice.projections.port import RoomListEntry

_log = get_logger("roomservice.projections.redis")

HEAT_MAX: Final = 2**63 - 1  # room_meta.heat is a signed 64-bit integer: 19 digits
_HEAT_DIGITS: Final = 19
TOMBSTONE_TTL_MS: Final = 86_400_000
REBUILD_CONCURRENCY: Final = 8  # rooms written to Redis at once during a rebuild

# What a rebuild loads: full room states (list entry and presence) or list entries alone.

APPLIED, STALE, NEED_FULL = 0, 1, 2

# KEYS: rooms zset, room hash, members set, presence hash, joined-at hash
# ARGV: version, mode (diff|full|entry), base version, room_id, open ("1"/"0"), score, zmember,
#       tombstone ttl ms, n, then n (user, joined_at_ms) pairs (diff: who joined; full: every member),
#       then (diff) the users who left
_APPLY: Final = """
local version = tonumber(ARGV[1])
local stored = tonumber(redis.call('HGET', KEYS[2], 'v') or '0')
if stored >= version then return 1 end
local mode = ARGV[2]
if mode == 'diff' then
  if stored ~= tonumber(ARGV[3]) then return 2 end
  if stored > 0 and redis.call('HGET', KEYS[2], 'mk') ~= '1' then return 2 end
end
local room_id = ARGV[4]
local open = ARGV[5] == '1'
local n = tonumber(ARGV[9])
local last = 9 + 2 * n
local function forget(user)
  redis.call('SREM', KEYS[3], user)
  if redis.call('HGET', KEYS[4], user) == room_id then
    redis.call('HDEL', KEYS[4], user)
    redis.call('HDEL', KEYS[5], user)
  end
end
-- a user in several rooms is present in the one joined last
local function credit(user, joined_at)
  redis.call('SADD', KEYS[3], user)
  local since = tonumber(redis.call('HGET', KEYS[5], user) or '-1')
  if redis.call('HGET', KEYS[4], user) == room_id or tonumber(joined_at) >= since then
    redis.call('HSET', KEYS[4], user, room_id)
    redis.call('HSET', KEYS[5], user, joined_at)
  end
end
if mode == 'diff' then
  for i = 10, last, 2 do credit(ARGV[i], ARGV[i + 1]) end
  for i = last + 1, #ARGV do forget(ARGV[i]) end
elseif mode == 'full' then
  local now = {}
  for i = 10, last, 2 do now[ARGV[i]] = true end
  for _, user in ipairs(redis.call('SMEMBERS', KEYS[3])) do
    if not now[user] then forget(user) end
  end
  for i = 10, last, 2 do
    if redis.call('SISMEMBER', KEYS[3], ARGV[i]) == 0 then credit(ARGV[i], ARGV[i + 1]) end
  end
end
local old = redis.call('HGET', KEYS[2], 'z')
if old then redis.call('ZREM', KEYS[1], old) end
if open then
  redis.call('ZADD', KEYS[1], tonumber(ARGV[6]), ARGV[7])
  local known = '1'
  if mode == 'entry' then known = '0' end
  redis.call('HSET', KEYS[2], 'v', version, 'z', ARGV[7], 'mk', known)
  redis.call('PERSIST', KEYS[2])
else
  for _, user in ipairs(redis.call('SMEMBERS', KEYS[3])) do forget(user) end
  redis.call('DEL', KEYS[3])
  redis.call('HDEL', KEYS[2], 'z', 'mk')
  redis.call('HSET', KEYS[2], 'v', version)
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[8]))
end
return 0
"""


class ProjectionsUnavailable(errors.Unavailable):
    """Redis did not answer (or the rebuild from the database failed): the projections cannot be read or written."""

    default_message = "room list and presence unavailable (Redis)"


def connect(url: str, *, timeout_s: float = 1.0) -> aioredis.Redis:
    """A client whose every call is bounded: connect and socket timeouts, one immediate retry (a stale pooled
    connection after a Redis restart), no backoff. ``url`` may carry the password (RedisConfig.connect_url())."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
        decode_responses=True,
    )


def _sort_member(entry: RoomListEntry) -> str:
    heat = min(max(entry.heat, 0), HEAT_MAX)
    body = json.dumps(entry.to_dict(), separators=(",", ":"), ensure_ascii=False)
    # "\n" sorts before every room id character, so a room id that prefixes another sorts first (as in Python)
    return f"{HEAT_MAX - heat:0{_HEAT_DIGITS}d}{entry.room_id}\n{body}"


def _entry_of(app_code: str, member: str) -> RoomListEntry:
    _, _, body = member.partition("\n")
    data: dict[str, Any] = json.loads(body)
    return RoomListEntry(
        app_code=app_code,
        room_id=data["room_id"],
        title=data["title"],
        owner_id=data["owner_id"],
        status=data["status"],
        member_count=data["member_count"],
        heat=data["heat"],
        version=data["version"],
    )


class RedisProjections:
    """The projections port on Redis. ``loader`` (optional) rebuilds Redis from the database when the marker is
    missing: :func:`store_loader` builds one from the room store."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = "roomservice:",
        loader: Loader | None = None,
        timeout_s: float = 2.0,
        rebuild_timeout_s: float = 30.0,
        tombstone_ttl_ms: int = TOMBSTONE_TTL_MS,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.loader = loader
        self.timeout_s = timeout_s
        self.rebuild_timeout_s = rebuild_timeout_s
        self.tombstone_ttl_ms = tombstone_ttl_ms
        self.marker_key = f"{prefix}projections:built"
        self._apply = client.register_script(_APPLY)
        self._rebuild: asyncio.Task[bool] | None = None
        self.rebuilds = 0  # completed rebuilds (observability, tests)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str,
        loader: Loader | None = None,
        timeout_s: float = 1.0,
        rebuild_timeout_s: float = 30.0,
    ) -> RedisProjections:
        """A client of its own on ``url``; every call fails within ``2 * timeout_s`` (one retry)."""
        return cls(
            connect(url, timeout_s=timeout_s),
            prefix=prefix,
            loader=loader,
            timeout_s=2 * timeout_s,
            rebuild_timeout_s=rebuild_timeout_s,
        )

    async def close(self) -> None:
        if self._rebuild is not None and not self._rebuild.done():
            self._rebuild.cancel()
        await self.client.aclose()

    # ---------------------------------------------------------------- keys

    def _keys(self, app_code: str, room_id: str) -> list[str]:
        tag = f"{{{app_code}}}"
        p = self.prefix
        return [
            f"{p}rooms:{tag}",
            f"{p}room:{tag}:{room_id}",
            f"{p}members:{tag}:{room_id}",
            f"{p}presence:{tag}",
            f"{p}joined:{tag}",
        ]

    def _rooms_key(self, app_code: str) -> str:
        return f"{self.prefix}rooms:{{{app_code}}}"

    def _presence_key(self, app_code: str) -> str:
        return f"{self.prefix}presence:{{{app_code}}}"

    # ---------------------------------------------------------------- writes

    async def room_changed(self, before: RoomState | None, after: RoomState) -> None:
        now = after.members if after.status != CLOSED else {}
        old = before.members if before is not None else {}
        joined = [(u, at) for u, at in now.items() if u not in old]
        left = [u for u in old if u not in now]
        base = before.version if before is not None else 0
        entry = RoomListEntry.of(after)
        async with self._bounded("room_changed"):
            result = await self._run(entry, "diff", base, joined, left)
            if result == NEED_FULL:
                await self._run(entry, "full", 0, list(now.items()), [])

    async def seed(self, entries: list[RoomListEntry]) -> None:
        async with self._bounded("seed"):
            for entry in entries:
                await self._run(entry, "entry", 0, [], [])

    async def _run(
        self, entry: RoomListEntry, mode: str, base: int, users: list[tuple[str, int]], removed: list[str]
    ) -> int:
        args: list[str | int] = [
            entry.version,
            mode,
            base,
            entry.room_id,
            "0" if entry.status == CLOSED else "1",
            -entry.member_count,
            _sort_member(entry),
            self.tombstone_ttl_ms,
            len(users),
            *(part for user, joined_at in users for part in (user, joined_at)),
            *removed,
        ]
        return int(await self._apply(keys=self._keys(entry.app_code, entry.room_id), args=args))

    # ---------------------------------------------------------------- reads

    async def list_rooms(self, app_code: str, *, limit: int) -> list[RoomListEntry]:
        if limit < 1:
            return []
        members = await self._read("list_rooms", lambda pipe: pipe.zrange(self._rooms_key(app_code), 0, limit - 1))
        return [_entry_of(app_code, m) for m in members]

    async def room_of(self, app_code: str, user_id: str) -> str | None:
        room: str | None = await self._read("room_of", lambda pipe: pipe.hget(self._presence_key(app_code), user_id))
        return room

    async def _read(self, what: str, command: Callable[[Any], Any]) -> Any:
        """One round trip: the marker and the read; a missing marker rebuilds first (when a loader is set)."""
        for _attempt in range(2):
            async with self._bounded(what):
                pipe = self.client.pipeline(transaction=False)
                pipe.exists(self.marker_key)
                command(pipe)
                built, value = await pipe.execute()
            if built or self.loader is None:
                return value
            await self.rebuild_if_empty(self.loader)
        return value

    # ---------------------------------------------------------------- rebuild

    async def rebuild_if_empty(self, load: Loader) -> bool:
        """Rebuild from ``load`` when the marker is missing; True when this call (or the one it joined) rebuilt.

        Single-flight in this process: concurrent callers await the same rebuild. Bounded by
        ``rebuild_timeout_s``; a failure raises :class:`ProjectionsUnavailable` and the next call tries again.
        Other processes may rebuild at the same time: every write is version-guarded, so that is only work.
        """
        if self._rebuild is None or self._rebuild.done():
            self._rebuild = asyncio.create_task(self._rebuild_once(load), name="projections-rebuild")
        return await asyncio.shield(self._rebuild)

    async def _rebuild_once(self, load: Loader) -> bool:
        async with self._bounded("rebuild"):
            if await self.client.exists(self.marker_key):
                return False
        try:
            async with asyncio.timeout(self.rebuild_timeout_s):
                items = await load()
                gate = asyncio.Semaphore(REBUILD_CONCURRENCY)

                async def put(item: RebuildItem) -> None:
                    async with gate:
                        if isinstance(item, RoomState):
                            await self.room_changed(None, item)  # a diff from nothing, or the whole member list
                        else:
                            await self.seed([item])

                await asyncio.gather(*(put(item) for item in items))
                await self.client.set(self.marker_key, "1")
        except ProjectionsUnavailable:
            raise
        except (TimeoutError, RedisError, OSError) as exc:
            _log.warning("projections_rebuild_failed", error=repr(exc))
            raise ProjectionsUnavailable(f"projections rebuild failed: {exc!r}") from exc
        except errors.RoomServiceError as exc:  # the database did not answer
            _log.warning("projections_rebuild_failed", error=repr(exc))
            raise ProjectionsUnavailable(f"projections rebuild failed: {exc.message}") from exc
        self.rebuilds += 1
        _log.info("projections_rebuilt", rooms=len(items), prefix=self.prefix)
        return True

    @asynccontextmanager
    async def _bounded(self, what: str) -> AsyncIterator[None]:
        """An outer deadline around Redis calls; Redis and socket errors become :class:`ProjectionsUnavailable`."""
        try:
            async with asyncio.timeout(self.timeout_s):
                yield
        except TimeoutError as exc:  # the deadline, or a socket timeout
            raise ProjectionsUnavailable(f"Redis did not answer {what} within {self.timeout_s}s") from exc
        except (RedisError, OSError) as exc:
            raise ProjectionsUnavailable(f"Redis {what} failed: {exc!r}") from exc
