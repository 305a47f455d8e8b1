"""Redis leases for real: renewal, a paused holder, takeover with fencing, owner lookup, Redis outages.

Each "process" is its own :class:`RedisLeases` (own owner identity; the fencing
test also gives each its own database pool and RoomService). Lease timings are
a fraction of a second to a few seconds; the tests that are about the passage of
time wait for it, every other wait is a poll with a deadline. Keys live under a
unique prefix on the shared Redis (deleted after); the outage tests run their own
``redis-server`` (tests/redis_server.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import sqlalchemy as sa
from tests.conftest import RequireService
from tests.contracts.test_outbox_repository import second_process
from tests.redis_server import REDIS_SERVER, OwnRedisServer

from roomservice import errors
from roomservice.cell.registry import CellRegistry
from roomservice.config import RedisConfig
from roomservice.domain import commands as c
from roomservice.domain.rules import Gift, RoomRules
from roomservice.leases.port import Lease, LeaseBackendUnavailable, LeaseOwner, LeaseUnavailable
from roomservice.leases.redis import RedisLeases, call_bound_s, redis_client
from roomservice.projections.port import InProcessProjections
from roomservice.service import RoomService, ServiceOptions
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.store.sql import SqlRoomStore
from roomservice.wallet.fake import FakeWallet
from roomservice.wallet.journal import DebitJournal
from roomservice.wallet.reconcile import Reconciler

T = TypeVar("T")
APP, ROOM = "demo", "room-1"
SLACK = 0.5  # scheduling noise on a shared 2-core machine
RULES = RoomRules(
    gifts={"rose": Gift("rose", "Rose", 10)}, default_seat_count=8, default_ban_seconds=600, treasure_levels=(1000,)
)


async def eventually(probe: Callable[[], Awaitable[T]], *, within_s: float, what: str) -> T:
    """``probe()`` until it returns without raising; fails after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await probe()
        except Exception:
            if time.monotonic() >= deadline:
                raise AssertionError(f"{what}: still failing after {within_s:g}s") from None
            await asyncio.sleep(0.01)


async def until(condition: Callable[[], bool], *, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {within_s:g}s")
        await asyncio.sleep(0.005)


class Manager:
    """Builds lease managers ("processes") on one client and prefix, and cleans their keys up."""

    def __init__(self, client: aioredis.Redis, *, call_timeout_s: float = 2.0) -> None:
        self.client = client
        self.prefix = f"test-redis-leases-{uuid.uuid4().hex[:12]}:"
        self.call_timeout_s = call_timeout_s
        self.loops: list[asyncio.Task[None]] = []

    def new(
        self,
        owner: str,
        *,
        ttl_s: float,
        renew_every_s: float,
        safety_margin_s: float,
        address: str = "127.0.0.1:7000",
        on_lost: Callable[[str, str], None] | None = None,
        renewing: bool = False,
    ) -> RedisLeases:
        leases = RedisLeases(
            self.client,
            owner=owner,
            address=address,
            ttl_s=ttl_s,
            renew_every_s=renew_every_s,
            safety_margin_s=safety_margin_s,
            call_timeout_s=self.call_timeout_s,
            key_prefix=self.prefix,
            on_lost=on_lost,
        )
        if renewing:
            self.loops.append(asyncio.get_running_loop().create_task(leases.run_renewal()))
        return leases

    async def close(self) -> None:
        for loop in self.loops:
            loop.cancel()
        await asyncio.gather(*self.loops, return_exceptions=True)
        try:
            keys = [key async for key in self.client.scan_iter(match=self.prefix + "*")]
            if keys:
                await self.client.delete(*keys)
        finally:
            await self.client.aclose()


@pytest_asyncio.fixture
async def shared(require_service: RequireService) -> AsyncIterator[Manager]:
    require_service("Redis", "127.0.0.1", 6379)
    manager = Manager(aioredis.Redis(host="127.0.0.1", port=6379, decode_responses=True, socket_timeout=2.0))
    try:
        yield manager
    finally:
        await manager.close()


@pytest.fixture
def own_redis() -> Iterator[OwnRedisServer]:
    if not os.path.exists(REDIS_SERVER):
        pytest.fail(f"{REDIS_SERVER} is needed for the Redis outage tests", pytrace=False)
    server = OwnRedisServer()
    server.start()
    try:
        yield server
    finally:
        server.kill()


# Call bounds of the outage tests: connecting 200ms + reading 200ms.
OUTAGE_CONFIG = {"socket_timeout": "200ms", "socket_connect_timeout": "200ms"}


@pytest_asyncio.fixture
async def outage(own_redis: OwnRedisServer) -> AsyncIterator[tuple[Manager, float]]:
    config = RedisConfig.model_validate({"url": own_redis.url, **OUTAGE_CONFIG})
    bound = call_bound_s(config)
    manager = Manager(redis_client(config), call_timeout_s=bound)
    try:
        yield manager, bound
    finally:
        own_redis.resume()
        for loop in manager.loops:
            loop.cancel()
        await asyncio.gather(*manager.loops, return_exceptions=True)
        await manager.client.aclose()


def renewal_point(leases: RedisLeases, lease: Lease) -> float:
    """When ``lease`` (as acquired) must be confirmed again: ``renew_every`` after its acquire was sent."""
    return lease.expires_at - leases.ttl_s + leases.safety_margin_s + leases.renew_every_s


async def timed(call: Awaitable[Any]) -> tuple[BaseException | None, float]:
    """Await ``call`` (never longer than 10s); its exception (or None) and how long it took."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(10.0):
            await call
    except TimeoutError:
        raise AssertionError("a Redis call hung: it is not bounded") from None
    except Exception as exc:
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


# --------------------------------------------------------------------------- renewal


async def test_the_renewal_loop_keeps_a_lease_alive_past_its_ttl(shared: Manager) -> None:
    holder = shared.new("proc-a", ttl_s=0.6, renew_every_s=0.15, safety_margin_s=0.2, renewing=True)
    other = shared.new("proc-b", ttl_s=0.6, renew_every_s=0.15, safety_margin_s=0.2)
    lease = await holder.acquire(APP, ROOM)
    started = time.monotonic()
    await asyncio.sleep(3 * 0.6)  # the passage of time is the point: three ttls, no command in between
    assert time.monotonic() - started >= 3 * 0.6
    with pytest.raises(LeaseUnavailable):
        await other.acquire(APP, ROOM)
    assert 0 < await shared.client.pttl(holder.key(APP, ROOM)) <= 600
    assert holder.held()[0].expires_at > lease.expires_at  # renewed in the background
    assert (await holder.ensure(lease)).token == lease.token  # the cell's old copy is still good


async def test_a_paused_holder_stops_before_its_lease_could_have_expired_elsewhere(shared: Manager) -> None:
    ttl_s, margin_s = 1.0, 0.4
    paused = shared.new("proc-a", ttl_s=ttl_s, renew_every_s=0.2, safety_margin_s=margin_s)  # renews nothing
    other = shared.new("proc-b", ttl_s=ttl_s, renew_every_s=0.2, safety_margin_s=margin_s)
    lease = await paused.acquire(APP, ROOM)
    await until(lambda: paused.clock() >= lease.expires_at, within_s=ttl_s + SLACK, what="the local deadline")
    left_ms = await shared.client.pttl(paused.key(APP, ROOM))
    with pytest.raises(LeaseUnavailable, match="could have expired"):
        await paused.ensure(lease)
    # when the holder stopped, its lease was still live in Redis: nobody else could have the room yet
    assert left_ms > 100, left_ms
    with pytest.raises(LeaseUnavailable, match="held by proc-a"):
        await other.acquire(APP, ROOM)
    taken = await eventually(lambda: other.acquire(APP, ROOM), within_s=ttl_s + SLACK, what="takeover")
    with pytest.raises(LeaseUnavailable):
        await paused.ensure(lease)  # dead for good, even now that Redis answers about the room
    assert (await other.ensure(taken)).token == taken.token


# --------------------------------------------------------------------------- takeover and fencing


class GatedWallet(FakeWallet):
    """A wallet whose debit waits for ``gate``: holds its command between its lease check and its commit."""

    def __init__(self) -> None:
        super().__init__(starting_balance=10_000)
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        self.gate.set()

    async def debit(self, **kwargs: Any) -> Any:
        self.entered.set()
        await self.gate.wait()
        return await super().debit(**kwargs)


def room_service(db: Database, leases: RedisLeases, wallet: FakeWallet) -> RoomService:
    store = SqlRoomStore(db)
    return RoomService(
        store=store,
        registry=CellRegistry(store=store, leases=leases, idle_after_s=600.0),
        rules=RULES,
        wallet=wallet,
        journal=DebitJournal(db),
        projections=InProcessProjections(),
        options=ServiceOptions(wallet_timeout_s=30.0),
    )


async def logged(db: Database) -> list[tuple[str, int]]:
    log = t.room_command_log.c
    async with db.read() as conn:
        rows = await conn.execute(
            sa.select(log.command_id, log.version).where(log.app_code == APP, log.room_id == ROOM).order_by(log.id)
        )
        return [(str(cid), int(v)) for cid, v in rows.all()]


async def test_a_second_process_takes_the_room_only_after_expiry_and_the_first_cannot_commit(
    shared: Manager, database: Database, backend_url: str
) -> None:
    timing = {"ttl_s": 1.5, "renew_every_s": 0.3, "safety_margin_s": 0.4}
    wallet_a = GatedWallet()
    async with second_process(backend_url) as db_b:
        a = room_service(database, shared.new("proc-a", **timing), wallet_a)  # renews only on its commands
        b = room_service(db_b, shared.new("proc-b", **timing), FakeWallet())
        await a.execute(APP, ROOM, "c1", c.CreateRoom(owner_id="olivia", title="Friday"))
        await a.execute(APP, ROOM, "c2", c.JoinRoom(user_id="alice"))

        # A checks its lease, then stalls in the wallet: a GC pause between its check and its commit
        wallet_a.gate.clear()
        gift = asyncio.create_task(
            a.execute(APP, ROOM, "c3", c.SendGift(sender_id="alice", receiver_id="olivia", gift_id="rose", count=1))
        )
        await asyncio.wait_for(wallet_a.entered.wait(), 5.0)
        cell_a = a.registry.peek(APP, ROOM)
        assert cell_a is not None

        # B is refused while A's lease lives, and gets the room once it ran out in Redis
        with pytest.raises(errors.Retry):
            await b.execute(APP, ROOM, "c4", c.JoinRoom(user_id="bob"))
        cell_b = await eventually(lambda: b.registry.cell(APP, ROOM), within_s=1.5 + SLACK, what="takeover")
        assert cell_b.epoch > cell_a.epoch  # taking the lease bumped the fencing epoch

        # A wakes up and commits on its old epoch: refused, and its cell is dropped
        wallet_a.gate.set()
        with pytest.raises(errors.Retry):
            await gift
        assert a.registry.peek(APP, ROOM) is None
        assert await logged(database) == [("c1", 1), ("c2", 2)]

        body = await b.execute(APP, ROOM, "c4", c.JoinRoom(user_id="bob"))
        assert body["version"] == 3
        with pytest.raises(errors.Retry):  # A cannot take the room back while B holds it
            await a.execute(APP, ROOM, "c5", c.JoinRoom(user_id="carol"))
        assert await logged(database) == [("c1", 1), ("c2", 2), ("c4", 3)]
        await b.registry.close()
        await a.registry.close()


# --------------------------------------------------------------------------- forwarding


async def test_owner_of_names_the_holders_address_and_token(shared: Manager) -> None:
    holder = shared.new("proc-a", ttl_s=5.0, renew_every_s=1.0, safety_margin_s=1.0, address="10.0.0.5:7001")
    other = shared.new("proc-b", ttl_s=5.0, renew_every_s=1.0, safety_margin_s=1.0, address="10.0.0.6:7001")
    assert await other.owner_of(APP, ROOM) is None
    lease = await holder.acquire(APP, ROOM)
    assert await other.owner_of(APP, ROOM) == LeaseOwner(owner="proc-a", address="10.0.0.5:7001", token=lease.token)
    assert json.loads(await shared.client.get(holder.key(APP, ROOM)) or "{}") == {
        "token": lease.token,
        "owner": "proc-a",
        "address": "10.0.0.5:7001",
    }
    await holder.release(lease)
    assert await other.owner_of(APP, ROOM) is None


# --------------------------------------------------------------------------- losing a lease


async def test_on_lost_fires_when_the_lease_is_taken_over_behind_the_holders_back(shared: Manager) -> None:
    lost: list[tuple[str, str]] = []
    fired = asyncio.Event()

    def on_lost(app_code: str, room_id: str) -> None:
        lost.append((app_code, room_id))
        fired.set()

    holder = shared.new("proc-a", ttl_s=2.0, renew_every_s=0.2, safety_margin_s=0.5, on_lost=on_lost, renewing=True)
    lease = await holder.acquire(APP, ROOM)
    kept = await holder.acquire(APP, "room-2")
    other = {"token": "someone-else", "owner": "proc-b", "address": "10.0.0.6:7001"}
    await shared.client.set(holder.key(APP, ROOM), json.dumps(other), px=2000)
    await asyncio.wait_for(fired.wait(), 0.2 + SLACK)
    assert lost == [(APP, ROOM)]
    assert [h.token for h in holder.held()] == [kept.token]
    with pytest.raises(LeaseUnavailable):
        await holder.ensure(lease)
    await holder.release(lease)  # the late release spares the new holder
    assert (await holder.owner_of(APP, ROOM)) == LeaseOwner("proc-b", "10.0.0.6:7001", "someone-else")


async def test_on_lost_fires_by_the_deadline_when_redis_cannot_confirm_a_renewal(
    outage: tuple[Manager, float], own_redis: OwnRedisServer
) -> None:
    manager, _bound = outage
    ttl_s, margin_s = 2.0, 1.0
    fired_at: list[float] = []
    holder: RedisLeases | None = None

    def on_lost(app_code: str, room_id: str) -> None:
        assert holder is not None
        fired_at.append(holder.clock())

    holder = manager.new(
        "proc-a", ttl_s=ttl_s, renew_every_s=0.2, safety_margin_s=margin_s, on_lost=on_lost, renewing=True
    )
    lease = await holder.acquire(APP, ROOM)
    own_redis.pause()  # renewals hang from now on
    await until(lambda: bool(fired_at), within_s=ttl_s + SLACK, what="on_lost")
    # reported at the local deadline, before the key could have expired in Redis (deadline + margin)
    assert lease.expires_at <= fired_at[0] < lease.expires_at + margin_s, fired_at[0] - lease.expires_at
    assert holder.held() == []
    own_redis.resume()
    with pytest.raises(LeaseUnavailable):  # Redis answering again does not bring the lease back
        await holder.ensure(lease)


# --------------------------------------------------------------------------- Redis outages


async def test_calls_fail_within_the_bound_while_redis_hangs_and_the_same_manager_carries_on(
    outage: tuple[Manager, float], own_redis: OwnRedisServer
) -> None:
    manager, bound = outage
    leases = manager.new("proc-a", ttl_s=4.0, renew_every_s=0.3, safety_margin_s=1.0)
    lease = await leases.acquire(APP, ROOM)
    own_redis.pause()

    error, took = await timed(leases.acquire(APP, "room-2"))
    assert isinstance(error, LeaseBackendUnavailable) and took < bound + SLACK, (error, took)
    assert error.code == "unavailable" and error.retryable  # 503 unavailable: retry with the same command_id
    error, took = await timed(leases.owner_of(APP, ROOM))
    assert isinstance(error, LeaseBackendUnavailable) and took < bound + SLACK, (error, took)

    # past its renewal point, the lease cannot be confirmed: unavailable, but not lost
    await until(lambda: leases.clock() >= renewal_point(leases, lease), within_s=1.0, what="renewal point")
    error, took = await timed(leases.ensure(lease))
    assert isinstance(error, LeaseBackendUnavailable) and took < bound + SLACK, (error, took)
    assert [h.token for h in leases.held()] == [lease.token]

    own_redis.resume()  # Redis is back: the same manager, no restart
    renewed = await eventually(lambda: leases.ensure(lease), within_s=2.0, what="ensure after Redis is back")
    assert renewed.token == lease.token and renewed.expires_at > lease.expires_at
    await eventually(lambda: leases.acquire(APP, "room-2"), within_s=2.0, what="acquire after Redis is back")


async def test_a_redis_restart_fails_calls_quickly_and_service_comes_back_without_a_new_manager(
    outage: tuple[Manager, float], own_redis: OwnRedisServer
) -> None:
    manager, bound = outage
    leases = manager.new("proc-a", ttl_s=4.0, renew_every_s=0.3, safety_margin_s=1.0)
    lease = await leases.acquire(APP, ROOM)
    own_redis.kill()

    for call in (leases.acquire(APP, "room-2"), leases.owner_of(APP, ROOM)):
        error, took = await timed(call)
        assert isinstance(error, LeaseBackendUnavailable) and took < bound + SLACK, (error, took)
    error, _ = await timed(leases.release(lease))
    assert error is None  # release is best effort: the key expires by itself

    own_redis.start()  # same port, empty: the restart lost every key (and the script cache)
    other = await eventually(lambda: leases.acquire(APP, "room-2"), within_s=2.0, what="acquire after restart")
    assert (await leases.owner_of(APP, "room-2")) == LeaseOwner("proc-a", "127.0.0.1:7000", other.token)


async def test_a_lease_redis_forgot_in_a_restart_is_lost_at_its_next_renewal(
    outage: tuple[Manager, float], own_redis: OwnRedisServer
) -> None:
    manager, _bound = outage
    leases = manager.new("proc-a", ttl_s=4.0, renew_every_s=0.3, safety_margin_s=1.0)
    lease = await leases.acquire(APP, ROOM)
    own_redis.kill()
    own_redis.start()
    await until(lambda: leases.clock() >= renewal_point(leases, lease), within_s=1.0, what="renewal point")
    deadline = time.monotonic() + 2.0
    while True:
        try:
            await leases.ensure(lease)
        except LeaseBackendUnavailable:
            assert time.monotonic() < deadline, "Redis did not come back"
            await asyncio.sleep(0.01)
            continue
        except LeaseUnavailable as exc:
            reason = str(exc)
            break
        raise AssertionError("a lease Redis no longer has was confirmed")
    assert "was lost" in reason, reason
    fresh = await leases.acquire(APP, ROOM)  # the room can be taken again (with a new epoch, by its registry)
    assert fresh.token != lease.token


async def test_commands_answer_503_unavailable_while_redis_is_away_and_recover_by_themselves(
    outage: tuple[Manager, float], own_redis: OwnRedisServer, database: Database
) -> None:
    manager, bound = outage
    leases = manager.new("proc-a", ttl_s=4.0, renew_every_s=0.3, safety_margin_s=1.0, renewing=True)
    service = room_service(database, leases, FakeWallet())
    await service.execute(APP, ROOM, "c1", c.CreateRoom(owner_id="olivia", title="Friday"))
    own_redis.kill()

    # a room no cell holds yet: its lease cannot be taken
    error, took = await timed(service.execute(APP, "room-2", "n1", c.CreateRoom(owner_id="olivia", title="Two")))
    assert isinstance(error, errors.Unavailable) and error.code == "unavailable", error
    assert took < bound + SLACK, took
    # the loaded room, once past its renewal point: its lease cannot be confirmed
    await until(lambda: leases.clock() >= renewal_point(leases, leases.held()[0]), within_s=1.0, what="renewal")
    error, took = await timed(service.execute(APP, ROOM, "c2", c.JoinRoom(user_id="alice")))
    assert isinstance(error, errors.Unavailable) and error.code == "unavailable", error
    assert took < bound + SLACK, took
    assert await logged(database) == [("c1", 1)]  # nothing half-written

    own_redis.start()  # back, empty: the same service and manager carry on, retries with the same ids succeed
    body = await eventually(
        lambda: service.execute(APP, ROOM, "c2", c.JoinRoom(user_id="alice")), within_s=3.0, what="c2 after Redis"
    )
    assert body["version"] == 2
    created = await eventually(
        lambda: service.execute(APP, "room-2", "n1", c.CreateRoom(owner_id="olivia", title="Two")),
        within_s=3.0,
        what="n1 after Redis",
    )
    assert created["version"] == 1
    assert await logged(database) == [("c1", 1), ("c2", 2)]
    await service.registry.close()


async def test_a_lease_lost_while_redis_hangs_evicts_the_rooms_cell_through_on_lost(
    outage: tuple[Manager, float], own_redis: OwnRedisServer, sqlite_database: Database
) -> None:
    """The wiring the process uses: ``on_lost`` discards the room's cell, so nothing serves it any more."""
    manager, _bound = outage
    leases = manager.new("proc-a", ttl_s=2.0, renew_every_s=0.2, safety_margin_s=1.0, renewing=True)
    service = room_service(sqlite_database, leases, FakeWallet())
    registry = service.registry

    def evict(app_code: str, room_id: str) -> None:
        cell = registry.peek(app_code, room_id)
        if cell is not None:
            registry.discard(cell)

    leases.on_lost = evict
    await service.execute(APP, ROOM, "c1", c.CreateRoom(owner_id="olivia", title="Friday"))
    cell = registry.peek(APP, ROOM)
    assert cell is not None
    own_redis.pause()
    await until(lambda: registry.peek(APP, ROOM) is None, within_s=2.0 + SLACK, what="eviction")
    assert cell.retired
    own_redis.resume()
    body = await eventually(
        lambda: service.execute(APP, ROOM, "c2", c.JoinRoom(user_id="alice")), within_s=3.0, what="reload"
    )
    assert body["version"] == 2
    reloaded = registry.peek(APP, ROOM)
    assert reloaded is not None and reloaded.epoch > cell.epoch  # taken again, with a new fencing epoch
    await registry.close()


def reconciler(service: RoomService, wallet: FakeWallet) -> Reconciler:
    """The reconciler of ``service``'s process, every journal entry old enough, turns as its registry takes them."""
    return Reconciler(
        journal=service.journal, wallet=wallet, store=service.store, reconcile_after_ms=0,
        clock=lambda: 2**62, room_turn=service.registry.holding,
    )  # fmt: skip


async def test_an_orphan_debit_of_a_busy_room_is_refunded_by_the_process_that_holds_it(
    shared: Manager, database: Database, backend_url: str
) -> None:
    """An entry is reconciled holding its room's turn, and only the lease holder can take it: the
    reconciler of a process that does not hold the room counts the entry ``held_elsewhere`` (not an
    error) and the holder's own refunds it, however busy the room stays (found by review: only the
    maintenance role reconciled, and a busy room held by a process without it was never refunded)."""
    timing = {"ttl_s": 5.0, "renew_every_s": 0.5, "safety_margin_s": 1.0}
    wallet = FakeWallet()  # the one external wallet both processes talk to
    async with second_process(backend_url) as db_b:
        a = room_service(database, shared.new("proc-a", renewing=True, **timing), wallet)  # serves the room
        b = room_service(db_b, shared.new("proc-b", **timing), wallet)
        await a.execute(APP, ROOM, "c1", c.CreateRoom(owner_id="olivia", title="Friday"))
        await a.execute(APP, ROOM, "c2", c.JoinRoom(user_id="alice"))
        wallet.fail_after_debit = True  # debited, the answer lost: 503, and the client gives up
        rose = c.SendGift(sender_id="alice", receiver_id="olivia", gift_id="rose", count=1)
        with pytest.raises(errors.Unavailable):
            await a.execute(APP, ROOM, "g1", rose)
        wallet.fail_after_debit = False
        charged = wallet.balances[(APP, "alice")]

        elsewhere = await reconciler(b, wallet).run_once()
        assert (elsewhere.checked, elsewhere.held_elsewhere, elsewhere.errors, elsewhere.refunded) == (1, 1, 0, 0)
        await a.execute(APP, ROOM, "j1", c.JoinRoom(user_id="u1"))  # the room stays busy on A
        here = await reconciler(a, wallet).run_once()
        assert (here.checked, here.refunded, here.held_elsewhere) == (1, 1, 0)
        assert wallet.balances[(APP, "alice")] == charged + 10  # the rose's price, back


async def test_a_turn_on_a_cell_whose_lease_ran_out_is_refused_and_the_new_holder_reconciles(
    shared: Manager, database: Database, backend_url: str
) -> None:
    """A process whose lease ran out (a pause, Redis forgetting its keys) still has the room's cell;
    a turn taken on it without confirming the lease let its reconciler refund a debit while the
    room's new holder could commit the retried gift that claims it (found by review). The turn now
    confirms the lease, as a command does before its commit."""
    timing = {"ttl_s": 1.0, "renew_every_s": 0.2, "safety_margin_s": 0.3}
    wallet = FakeWallet()
    async with second_process(backend_url) as db_b:
        a = room_service(database, shared.new("proc-a", **timing), wallet)  # renews only on its commands
        b = room_service(db_b, shared.new("proc-b", **timing), wallet)
        await a.execute(APP, ROOM, "c1", c.CreateRoom(owner_id="olivia", title="Friday"))
        await a.execute(APP, ROOM, "c2", c.JoinRoom(user_id="alice"))
        wallet.fail_after_debit = True
        rose = c.SendGift(sender_id="alice", receiver_id="olivia", gift_id="rose", count=1)
        with pytest.raises(errors.Unavailable):
            await a.execute(APP, ROOM, "g1", rose)
        wallet.fail_after_debit = False
        charged = wallet.balances[(APP, "alice")]
        await eventually(lambda: b.registry.cell(APP, ROOM), within_s=1.0 + SLACK, what="takeover")
        assert a.registry.peek(APP, ROOM) is not None  # A never heard: its cell is still there

        entered: list[str] = []
        with pytest.raises(LeaseUnavailable):
            async with a.registry.holding(APP, ROOM):
                entered.append("A")
        assert entered == [] and a.registry.peek(APP, ROOM) is None  # refused, and the stale cell is gone

        assert (await reconciler(a, wallet).run_once()).held_elsewhere == 1
        assert (await reconciler(b, wallet).run_once()).refunded == 1
        assert wallet.balances[(APP, "alice")] == charged + 10
        await b.registry.close()
        await a.registry.close()
