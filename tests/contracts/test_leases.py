"""Contract suite of the lease port (``roomservice.leases.port``), one subclass per adapter.

:class:`LeaseContract` is abstract (pytest does not collect it): an adapter's
suite subclasses it, provides the ``leases`` fixture and says how a lease is
lost behind its holder's back — revoked, expired, or stolen by another
process — through the three ``lose_*`` hooks. A future adapter (Redis leases)
adds one subclass here or imports ``LeaseContract`` into its own module.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import ClassVar

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from tests.conftest import RequireService

from roomservice.leases.fake import FakeLeases
from roomservice.leases.inprocess import InProcessLeases
from roomservice.leases.port import Lease, LeaseManager, LeaseUnavailable
from roomservice.leases.redis import RedisLeases

APP, OTHER_APP = "app_1", "app_2"
ROOM, OTHER_ROOM = "room-1", "room-2"


class LeaseContract:
    """What every :class:`LeaseManager` promises."""

    __test__: ClassVar[bool] = False

    @pytest.fixture
    def leases(self) -> LeaseManager:
        raise NotImplementedError("an adapter's suite provides the lease manager")

    async def lose_by_revocation(self, leases: LeaseManager, lease: Lease) -> None:
        """Take ``lease`` away from its holder (an operator deleting it)."""
        raise NotImplementedError

    async def lose_by_expiry(self, leases: LeaseManager, lease: Lease) -> Lease:
        """Let ``lease`` run out; return the lease as its (unaware) holder still has it."""
        raise NotImplementedError

    async def lose_by_theft(self, leases: LeaseManager, lease: Lease) -> Lease:
        """Another holder takes the room over; return the thief's lease."""
        raise NotImplementedError

    # ---------------------------------------------------------------- acquire / ensure

    async def test_acquire_grants_a_lease_on_the_room(self, leases: LeaseManager) -> None:
        lease = await leases.acquire(APP, ROOM)
        assert (lease.app_code, lease.room_id) == (APP, ROOM)
        assert isinstance(lease.token, str) and lease.token
        assert lease.expires_at > time.monotonic()

    async def test_ensure_passes_for_a_held_lease_and_keeps_its_identity(self, leases: LeaseManager) -> None:
        lease = await leases.acquire(APP, ROOM)
        for _ in range(3):  # ensured on every command
            renewed = await leases.ensure(lease)
            assert (renewed.app_code, renewed.room_id, renewed.token) == (lease.app_code, lease.room_id, lease.token)
            assert renewed.expires_at >= lease.expires_at
            lease = renewed

    async def test_a_renewed_lease_is_still_the_one_released(self, leases: LeaseManager) -> None:
        renewed = await leases.ensure(await leases.acquire(APP, ROOM))
        await leases.release(renewed)
        with pytest.raises(LeaseUnavailable):
            await leases.ensure(renewed)

    # ---------------------------------------------------------------- release

    async def test_release_then_ensure_raises(self, leases: LeaseManager) -> None:
        lease = await leases.acquire(APP, ROOM)
        await leases.release(lease)
        with pytest.raises(LeaseUnavailable):
            await leases.ensure(lease)

    async def test_a_released_room_can_be_acquired_again(self, leases: LeaseManager) -> None:
        first = await leases.acquire(APP, ROOM)
        await leases.release(first)
        second = await leases.acquire(APP, ROOM)
        assert second.token != first.token
        assert (await leases.ensure(second)).token == second.token

    async def test_releasing_twice_is_harmless(self, leases: LeaseManager) -> None:
        lease = await leases.acquire(APP, ROOM)
        await leases.release(lease)
        await leases.release(lease)
        with pytest.raises(LeaseUnavailable):
            await leases.ensure(lease)
        again = await leases.acquire(APP, ROOM)
        await leases.ensure(again)

    async def test_releasing_a_stale_lease_leaves_the_new_holder_alone(self, leases: LeaseManager) -> None:
        old = await leases.acquire(APP, ROOM)
        await leases.release(old)
        current = await leases.acquire(APP, ROOM)
        await leases.release(old)  # a late, second release by the previous holder
        assert (await leases.ensure(current)).token == current.token

    async def test_releasing_a_lease_with_another_token_does_nothing(self, leases: LeaseManager) -> None:
        held = await leases.acquire(APP, ROOM)
        forged = replace(held, token=held.token + "-not-mine")
        await leases.release(forged)
        assert (await leases.ensure(held)).token == held.token

    async def test_releasing_a_room_that_was_never_leased_is_harmless(self, leases: LeaseManager) -> None:
        await leases.release(Lease(APP, "never-leased", "no-such-token", float("inf")))
        await leases.ensure(await leases.acquire(APP, "never-leased"))

    # ---------------------------------------------------------------- losing a lease

    async def test_a_revoked_lease_fails_ensure(self, leases: LeaseManager) -> None:
        lease = await leases.acquire(APP, ROOM)
        await self.lose_by_revocation(leases, lease)
        with pytest.raises(LeaseUnavailable):
            await leases.ensure(lease)

    async def test_an_expired_lease_fails_ensure(self, leases: LeaseManager) -> None:
        lease = await leases.acquire(APP, ROOM)
        stale = await self.lose_by_expiry(leases, lease)
        with pytest.raises(LeaseUnavailable):
            await leases.ensure(stale)

    async def test_a_stolen_lease_fails_ensure_and_its_release_spares_the_thief(self, leases: LeaseManager) -> None:
        lease = await leases.acquire(APP, ROOM)
        thief = await self.lose_by_theft(leases, lease)
        assert thief.token != lease.token
        with pytest.raises(LeaseUnavailable):
            await leases.ensure(lease)
        await leases.release(lease)  # the paused ex-holder wakes up and lets go
        assert (await leases.ensure(thief)).token == thief.token

    async def test_at_most_one_live_lease_per_room(self, leases: LeaseManager) -> None:
        """A second acquire of a held room is refused, or supersedes the first: never two holders."""
        first = await leases.acquire(APP, ROOM)
        try:
            second = await leases.acquire(APP, ROOM)
        except LeaseUnavailable:
            assert (await leases.ensure(first)).token == first.token
            return
        assert second.token != first.token
        assert (await leases.ensure(second)).token == second.token
        with pytest.raises(LeaseUnavailable):
            await leases.ensure(first)

    # ---------------------------------------------------------------- rooms and tokens

    async def test_distinct_rooms_are_independent(self, leases: LeaseManager) -> None:
        a = await leases.acquire(APP, ROOM)
        b = await leases.acquire(APP, OTHER_ROOM)
        c = await leases.acquire(OTHER_APP, ROOM)  # the same room id in another app is another room
        assert len({a.token, b.token, c.token}) == 3
        await leases.release(a)
        await self.lose_by_revocation(leases, b)
        with pytest.raises(LeaseUnavailable):
            await leases.ensure(a)
        with pytest.raises(LeaseUnavailable):
            await leases.ensure(b)
        assert (await leases.ensure(c)).token == c.token
        a2 = await leases.acquire(APP, ROOM)
        assert (await leases.ensure(c)).token == c.token  # taking app_1's room left app_2's alone
        await leases.ensure(a2)

    async def test_tokens_are_unique(self, leases: LeaseManager) -> None:
        tokens: list[str] = []
        for round_ in range(5):
            for room in (ROOM, OTHER_ROOM, f"room-{round_ + 10}"):
                lease = await leases.acquire(APP, room)
                tokens.append(lease.token)
                await leases.release(lease)
        assert len(set(tokens)) == len(tokens)


# --------------------------------------------------------------------------- adapters


class TestInProcessLeases(LeaseContract):
    __test__ = True

    @pytest.fixture
    def leases(self) -> InProcessLeases:
        return InProcessLeases()

    async def lose_by_revocation(self, leases: LeaseManager, lease: Lease) -> None:
        assert isinstance(leases, InProcessLeases)
        leases.revoke(lease.app_code, lease.room_id)

    async def lose_by_expiry(self, leases: LeaseManager, lease: Lease) -> Lease:
        # in-process leases never expire by themselves; a lease whose deadline passed is refused
        return replace(lease, expires_at=time.monotonic() - 1)

    async def lose_by_theft(self, leases: LeaseManager, lease: Lease) -> Lease:
        return await leases.acquire(lease.app_code, lease.room_id)  # a new cell of the room supersedes


class TestFakeLeases(LeaseContract):
    __test__ = True

    @pytest.fixture(params=[None, 30.0], ids=["no-ttl", "ttl"])
    def leases(self, request: pytest.FixtureRequest) -> FakeLeases:
        return FakeLeases(ttl_s=request.param)

    async def lose_by_revocation(self, leases: LeaseManager, lease: Lease) -> None:
        assert isinstance(leases, FakeLeases)
        leases.revoke(lease.app_code, lease.room_id)

    async def lose_by_expiry(self, leases: LeaseManager, lease: Lease) -> Lease:
        assert isinstance(leases, FakeLeases)
        leases.expire(lease.app_code, lease.room_id)
        return lease

    async def lose_by_theft(self, leases: LeaseManager, lease: Lease) -> Lease:
        assert isinstance(leases, FakeLeases)
        return leases.steal(lease.app_code, lease.room_id)


class ManualClock:
    """``time.monotonic()`` that the test can also move ahead: losing a Redis lease is noticed at
    the lease's next renewal point, without waiting for it."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


REDIS_TTL_S, REDIS_RENEW_S, REDIS_MARGIN_S = 10.0, 3.0, 2.0


class TestRedisLeases(LeaseContract):
    """Redis leases against the shared Redis (keys under a unique prefix, deleted after).

    The holder's clock is manual: a lease lost in Redis (deleted, expired, overwritten) is
    noticed by ``ensure`` at the lease's renewal point, so the hooks move the clock past it.
    """

    __test__ = True

    @pytest_asyncio.fixture
    async def leases(self, require_service: RequireService) -> AsyncIterator[RedisLeases]:
        require_service("Redis", "127.0.0.1", 6379)
        client = aioredis.Redis(host="127.0.0.1", port=6379, decode_responses=True, socket_timeout=2.0)
        prefix = f"test-leases-{uuid.uuid4().hex[:12]}:"
        leases = self._manager(client, prefix, ManualClock(), owner="holder")
        try:
            yield leases
        finally:
            keys = [key async for key in client.scan_iter(match=prefix + "*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()

    @staticmethod
    def _manager(client: aioredis.Redis, prefix: str, clock: ManualClock, *, owner: str) -> RedisLeases:
        return RedisLeases(
            client,
            address="127.0.0.1:7000",
            owner=owner,
            ttl_s=REDIS_TTL_S,
            renew_every_s=REDIS_RENEW_S,
            safety_margin_s=REDIS_MARGIN_S,
            call_timeout_s=2.0,
            key_prefix=prefix,
            clock=clock,
        )

    @staticmethod
    def _past_renewal_point(leases: RedisLeases) -> None:
        assert isinstance(leases.clock, ManualClock)
        leases.clock.advance(REDIS_RENEW_S + 0.1)

    async def lose_by_revocation(self, leases: LeaseManager, lease: Lease) -> None:
        assert isinstance(leases, RedisLeases)
        assert await leases.client.delete(leases.key(lease.app_code, lease.room_id)) == 1
        self._past_renewal_point(leases)

    async def lose_by_expiry(self, leases: LeaseManager, lease: Lease) -> Lease:
        assert isinstance(leases, RedisLeases) and isinstance(leases.clock, ManualClock)
        assert await leases.client.pexpire(leases.key(lease.app_code, lease.room_id), 1)
        leases.clock.advance(REDIS_TTL_S)  # the holder's deadline passed too
        return lease

    async def lose_by_theft(self, leases: LeaseManager, lease: Lease) -> Lease:
        assert isinstance(leases, RedisLeases) and isinstance(leases.clock, ManualClock)
        key = leases.key(lease.app_code, lease.room_id)
        await leases.client.pexpire(key, 1)  # the holder's lease ran out in Redis...
        other = self._manager(leases.client, leases.key_prefix, leases.clock, owner="other-process")
        thief = await _acquire_when_free(other, lease.app_code, lease.room_id)  # ...and another process took it
        self._past_renewal_point(leases)
        return thief


async def _acquire_when_free(leases: RedisLeases, app_code: str, room_id: str) -> Lease:
    deadline = time.monotonic() + 5.0
    while True:
        try:
            return await leases.acquire(app_code, room_id)
        except LeaseUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.005)


# --------------------------------------------------------------------------- the fake's own controls


async def test_fake_refuses_a_room_held_elsewhere_until_it_is_released_or_expires() -> None:
    leases = FakeLeases()
    other = leases.hold(APP, ROOM)
    with pytest.raises(LeaseUnavailable):
        await leases.acquire(APP, ROOM)
    assert leases.holder(APP, ROOM) == "other-process"
    await leases.release(other)
    mine = await leases.acquire(APP, ROOM)
    assert leases.holder(APP, ROOM) == "self"

    leases.steal(APP, ROOM)
    with pytest.raises(LeaseUnavailable):
        await leases.ensure(mine)
    leases.expire(APP, ROOM)  # the thief's lease runs out: the room is free again
    assert leases.holder(APP, ROOM) is None
    await leases.ensure(await leases.acquire(APP, ROOM))


async def test_fake_counts_calls_and_can_be_down() -> None:
    leases = FakeLeases()
    lease = await leases.acquire(APP, ROOM)
    await leases.ensure(lease)
    await leases.ensure(lease)
    await leases.release(lease)
    assert dict(leases.calls) == {"acquire": 1, "ensure": 2, "release": 1}
    leases.down = True
    with pytest.raises(LeaseUnavailable):
        await leases.acquire(APP, ROOM)
    assert leases.calls["acquire"] == 2


async def test_fake_with_ttl_renews_on_ensure() -> None:
    leases = FakeLeases(ttl_s=30.0)
    lease = await leases.acquire(APP, ROOM)
    assert lease.expires_at != float("inf")
    renewed = await leases.ensure(lease)
    assert renewed.expires_at >= lease.expires_at
    with pytest.raises(LeaseUnavailable):  # a holder that let its own deadline pass is refused
        await leases.ensure(replace(lease, expires_at=time.monotonic() - 1))
