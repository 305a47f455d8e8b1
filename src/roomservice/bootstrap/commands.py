"""The command pipeline's parts: store, leases, Room Cells, wallet and journal, projections, RoomService,
and the forwarder every entrypoint calls it through.

``lease.driver: redis`` (scale-out): :class:`RedisLeases` (a lost lease evicts its
room's cell through ``on_lost``; the renewal loop runs in the background),
:class:`RedisProjections` shared by every process (rebuilt from the database when
Redis is found empty: at start in the background, and lazily by any read; a Redis
that is down at start is logged, never fatal), and a :class:`Forwarder` that sends
a room's commands to the process holding its lease. ``inprocess``: one process owns
every room, the projections live in this process (seeded from the database at start).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from roomservice.bootstrap.core import Core, ms
from roomservice.cell.registry import CellRegistry
from roomservice.domain.state import RoomState
from roomservice.forwarding import Forwarder
from roomservice.leases.inprocess import InProcessLeases
from roomservice.leases.port import LeaseManager
from roomservice.leases.redis import RedisLeases
from roomservice.observability.logging import get_logger
from roomservice.projections.loader import store_loader
from roomservice.projections.port import InProcessProjections, Projections, RoomListEntry
from roomservice.projections.redis import RedisProjections
from roomservice.service import RoomService, ServiceOptions
from roomservice.store.sql import SqlRoomStore
from roomservice.wallet.embedded import EmbeddedWallet
from roomservice.wallet.http import HttpWallet
from roomservice.wallet.journal import DebitJournal
from roomservice.wallet.port import Wallet
from roomservice.wallet.reconcile import Reconciler

_log = get_logger("roomservice.bootstrap")

PROJECTION_SEED_LIMIT = 10_000


@dataclass(slots=True)
class Commands:
    store: SqlRoomStore
    leases: LeaseManager
    registry: CellRegistry
    wallet: Wallet
    journal: DebitJournal
    service: RoomService
    forwarder: Forwarder
    reconciler: Reconciler

    @property
    def redis_leases(self) -> RedisLeases | None:
        return self.leases if isinstance(self.leases, RedisLeases) else None

    def start(self, core: Core) -> None:
        room = core.settings.room
        evict_every = max(1.0, min(60.0, room.idle_evict_after.total_seconds() / 4))
        core.spawn("cell-eviction", self.registry.run_eviction(interval_s=evict_every))
        # wherever cells live: a room another process holds is that process's to reconcile (on Redis
        # leases a consume process serving treasure wake-ups holds rooms too, with no maintenance role)
        core.spawn("projection-repair", self.service.run_projection_repair(interval_s=2.0))
        reconcile_every = core.settings.wallet.reconcile_interval.total_seconds()
        core.spawn("wallet-reconcile", self.reconciler.run(interval_s=reconcile_every))
        if self.redis_leases is not None:
            core.spawn("lease-renewal", self.redis_leases.run_renewal())
        projections = self.service.projections
        if isinstance(projections, RedisProjections) and projections.loader is not None:
            core.spawn("projections-rebuild", _rebuild_projections(projections))
        if isinstance(projections, InProcessProjections):  # seeded with the list; presence comes in the background
            projections.expect_restore()  # before any command is served (a process without loops restores none)
            core.spawn("presence-restore", _restore_presence(projections, self.store))

    async def stop(self) -> None:
        await self.registry.close()
        await self.forwarder.aclose()
        projections = self.service.projections
        if isinstance(projections, RedisProjections):
            await projections.close()
        if self.redis_leases is not None:
            await self.redis_leases.aclose()


async def _rebuild_projections(projections: RedisProjections) -> None:
    """Rebuild the shared projections if Redis has none; a failure is logged (the next read tries again)."""
    assert projections.loader is not None
    try:
        rebuilt = await projections.rebuild_if_empty(projections.loader)
        _log.info("projections_checked", rebuilt=rebuilt)
    except Exception as exc:
        _log.warning("projections_rebuild_failed", error=repr(exc))


async def _restore_presence(projections: InProcessProjections, store: SqlRoomStore) -> None:
    """Load the open rooms in full and restore who is in them; retried, 1 s doubling to 60 s, while the
    database does not answer (a room that does not load is skipped by the loader)."""
    load = store_loader(store, limit=PROJECTION_SEED_LIMIT)
    retry_s = 1.0
    while True:
        try:
            restored = await projections.restore(
                state for state in await load() if isinstance(state, RoomState)
            )
        except Exception as exc:
            _log.warning("presence_restore_failed", error=repr(exc), retry_in_s=retry_s)
            await asyncio.sleep(retry_s)
            retry_s = min(60.0, retry_s * 2)
            continue
        _log.info("presence_restored", rooms=restored)
        return


def _evict_on_lost(registry: CellRegistry) -> Callable[[str, str], None]:
    def on_lost(app_code: str, room_id: str) -> None:
        cell = registry.peek(app_code, room_id)
        if cell is not None:
            _log.warning("room_cell_evicted_lease_lost", app_code=app_code, room_id=room_id)
            registry.discard(cell)

    return on_lost


async def build_commands(core: Core, *, wallet: Wallet | None = None) -> Commands:
    settings = core.settings
    store = SqlRoomStore(core.db)
    store.render_ahead()  # before the first command, not during the first seconds of them
    scale_out = settings.lease.driver == "redis"
    # a Redis lease's address is set once the room API is bound (Process), before any lease is taken
    leases: LeaseManager = (
        RedisLeases.from_config(settings.redis, settings.lease, address="") if scale_out else InProcessLeases()
    )
    registry = CellRegistry(store=store, leases=leases, idle_after_s=settings.room.idle_evict_after.total_seconds())
    if isinstance(leases, RedisLeases):
        leases.on_lost = _evict_on_lost(registry)
    commit_wallet: EmbeddedWallet | None = None  # on the store's database: gifts debit in their commit
    if wallet is None:
        if settings.wallet.driver == "http":
            wallet = await core.stack.enter_async_context(HttpWallet.from_config(settings.wallet))
        else:
            wallet = commit_wallet = EmbeddedWallet(
                core.db, starting_balance=settings.wallet.starting_balance, clock=core.clock
            )
    journal = DebitJournal(core.db)
    projections: Projections
    if scale_out:
        projections = RedisProjections.from_url(
            settings.redis.connect_url(),
            prefix=settings.redis.key_prefix,
            loader=store_loader(store),
            timeout_s=settings.redis.socket_timeout.total_seconds(),
        )
    else:
        projections = await _seeded_projections(store)
    service = RoomService(
        store=store,
        registry=registry,
        rules=settings.room_rules(),
        wallet=wallet,
        journal=journal,
        projections=projections,
        options=ServiceOptions(
            snapshot_every_n=settings.room.snapshot_every_n,
            wallet_timeout_s=settings.wallet.timeout.total_seconds(),
        ),
        clock=core.clock,
        commit_wallet=commit_wallet,
    )
    forwarder = Forwarder(
        service,
        leases=leases if isinstance(leases, RedisLeases) else None,
        shared_secret=settings.grpc.shared_secret.get_secret_value(),
        timeout_s=settings.grpc.forward_timeout.total_seconds(),
    )
    reconciler = Reconciler(
        journal=journal,
        wallet=wallet,
        store=store,
        reconcile_after_ms=ms(settings.wallet.reconcile_after),
        clock=core.clock,
        room_turn=registry.holding,
    )
    return Commands(
        store=store,
        leases=leases,
        registry=registry,
        wallet=wallet,
        journal=journal,
        service=service,
        forwarder=forwarder,
        reconciler=reconciler,
    )


async def _seeded_projections(store: SqlRoomStore) -> InProcessProjections:
    projections = InProcessProjections()
    summaries = await store.list_room_summaries(limit=PROJECTION_SEED_LIMIT)
    await projections.seed(
        [
            RoomListEntry(
                app_code=r.app_code,
                room_id=r.room_id,
                title=r.title,
                owner_id=r.owner_id,
                status=r.status,
                member_count=r.member_count,
                heat=r.heat,
                version=r.version,
            )
            for r in summaries
        ]
    )
    return projections
