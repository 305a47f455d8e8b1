"""The command pipeline's parts: store, leases, Room Cells, wallet and journal, projections, RoomService."""

from __future__ import annotations

from dataclasses import dataclass

from roomservice.bootstrap.core import Core
from roomservice.cell.registry import CellRegistry
from roomservice.leases.inprocess import InProcessLeases
from roomservice.leases.port import LeaseManager
from roomservice.projections.port import InProcessProjections, RoomListEntry
from roomservice.service import RoomService, ServiceOptions
from roomservice.store.sql import SqlRoomStore
from roomservice.wallet.embedded import EmbeddedWallet
from roomservice.wallet.http import HttpWallet
from roomservice.wallet.journal import DebitJournal
from roomservice.wallet.port import Wallet

PROJECTION_SEED_LIMIT = 10_000


@dataclass(slots=True)
class Commands:
    store: SqlRoomStore
    leases: LeaseManager
    registry: CellRegistry
    wallet: Wallet
    journal: DebitJournal
    service: RoomService

    def start(self, core: Core) -> None:
        room = core.settings.room
        evict_every = max(1.0, min(60.0, room.idle_evict_after.total_seconds() / 4))
        core.spawn("cell-eviction", self.registry.run_eviction(interval_s=evict_every))

    async def stop(self) -> None:
        await self.registry.close()


async def build_commands(core: Core, *, wallet: Wallet | None = None) -> Commands:
    settings = core.settings
    store = SqlRoomStore(core.db)
    leases = InProcessLeases()
    registry = CellRegistry(store=store, leases=leases, idle_after_s=settings.room.idle_evict_after.total_seconds())
    if wallet is None:
        if settings.wallet.driver == "http":
            wallet = await core.stack.enter_async_context(HttpWallet.from_config(settings.wallet))
        else:
            wallet = EmbeddedWallet(core.db, starting_balance=settings.wallet.starting_balance, clock=core.clock)
    journal = DebitJournal(core.db)
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
    )
    return Commands(store=store, leases=leases, registry=registry, wallet=wallet, journal=journal, service=service)
