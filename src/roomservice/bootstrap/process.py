"""``Process``: the roles one room-service process runs, built from Settings, started and stopped together.

``serve`` runs every role (the outbox worker when ``outbox_worker.enabled``) and
the gRPC room API (``room_api=True``: bound to ``grpc.host``/``grpc.port``, its
address advertised in this process's Redis leases so the others forward to it);
``worker`` runs the outbox, timers and maintenance roles without HTTP. On Redis
leases every process that builds the command pipeline serves the room API too
(``worker``: the timers open treasure boxes and reconciliation takes a room's
turn; ``consume``: the treasure-open group), since a lease names its holder's
address and the others forward that room's commands there. Tests
start the same roles, built the same way; ``loops=False`` only leaves the
background loops unstarted for tests that drive them by hand.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Final

from roomservice.activity.service import RunningActivityService
from roomservice.admin.operations import OutboxAdmin
from roomservice.api.grpc import RunningRoomApi, start_room_api
from roomservice.bootstrap.broker import broker_check, consumer_groups, open_broker, publishes_to_broker
from roomservice.bootstrap.commands import Commands, build_commands
from roomservice.bootstrap.consumers import build_consumers, needs_commands, needs_im, start_consumers
from roomservice.bootstrap.core import Core
from roomservice.bootstrap.direct import DirectTargets, ImParts, start_im
from roomservice.bootstrap.maintenance import Maintenance, build_maintenance
from roomservice.bootstrap.outbox import build_outbox_worker, start_outbox_worker
from roomservice.brokers.port import Broker
from roomservice.cell.registry import CellRegistry
from roomservice.clock import wall_clock_ms
from roomservice.config import Settings
from roomservice.consumers.runtime import ConsumerRuntime
from roomservice.grpc_server import format_target
from roomservice.health import HealthChecks
from roomservice.integrations.im_sandbox.server import RunningSandbox
from roomservice.leases.port import LeaseManager
from roomservice.observability import tracing
from roomservice.observability.logging import get_logger
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.outbox.worker import OutboxWorker, new_owner
from roomservice.publishers.port import Publisher
from roomservice.service import RoomService
from roomservice.store.database import Database
from roomservice.store.migrate import opened_database
from roomservice.store.sql import SqlRoomStore
from roomservice.timers.treasure import DatabaseTreasureTimer, TreasureTimerRunner
from roomservice.wallet.port import Wallet
from roomservice.wallet.reconcile import Reconciler

_log = get_logger("roomservice.bootstrap")

API: Final = "api"  # the command pipeline and the admin operations behind HTTP (and later gRPC)
OUTBOX: Final = "outbox"  # the outbox worker and its publishers
TIMERS: Final = "timers"  # fires due treasure wake-ups through the command pipeline
MAINTENANCE: Final = "maintenance"  # retention, command-log pruning, backlog metrics
CONSUMERS: Final = "consumers"  # the broker's consumer groups this configuration enables
ROLES: Final = frozenset({API, OUTBOX, TIMERS, MAINTENANCE, CONSUMERS})
SERVE_ROLES: Final = ROLES
WORKER_ROLES: Final = frozenset({OUTBOX, TIMERS, MAINTENANCE})
CONSUME_ROLES: Final = frozenset({CONSUMERS})


@dataclass(slots=True)
class Process:
    core: Core
    roles: frozenset[str]
    commands: Commands | None = None
    outbox_admin: OutboxAdmin | None = None
    worker: OutboxWorker | None = None
    direct: DirectTargets | None = None
    treasure_timer: DatabaseTreasureTimer | None = None
    timer_runner: TreasureTimerRunner | None = None
    maintenance: Maintenance | None = None
    broker: Broker | None = None
    consumers: ConsumerRuntime | None = None
    im: ImParts | None = None
    room_api: RunningRoomApi | None = None

    # ------------------------------------------------------------------ the parts, by name

    @property
    def settings(self) -> Settings:
        return self.core.settings

    @property
    def db(self) -> Database:
        return self.core.db

    @property
    def health(self) -> HealthChecks:
        return self.core.health

    @property
    def service(self) -> RoomService:
        return self._commands().service

    @property
    def store(self) -> SqlRoomStore:
        return self._commands().store

    @property
    def registry(self) -> CellRegistry:
        return self._commands().registry

    @property
    def leases(self) -> LeaseManager:
        return self._commands().leases

    @property
    def wallet(self) -> Wallet:
        return self._commands().wallet

    @property
    def reconciler(self) -> Reconciler:
        return self._commands().reconciler

    @property
    def sandbox(self) -> RunningSandbox | None:
        return self.im.sandbox if self.im else None

    @property
    def activity_service(self) -> RunningActivityService | None:
        return self.direct.activity_service if self.direct else None

    def _commands(self) -> Commands:
        if self.commands is None:
            raise LookupError(f"no role of this process needs the command pipeline ({sorted(self.roles)})")
        return self.commands

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    @asynccontextmanager
    async def running(
        cls,
        settings: Settings,
        *,
        roles: Iterable[str] = SERVE_ROLES,
        clock: Callable[[], int] = wall_clock_ms,
        wallet: Wallet | None = None,
        publishers: Mapping[str, Publisher] | None = None,
        loops: bool = True,
        groups: frozenset[str] | None = None,
        room_api: bool = False,
    ) -> AsyncIterator[Process]:
        """Build and start ``roles``; stop everything on exit.

        ``wallet`` replaces the configured wallet and ``publishers`` adds or
        replaces delivery targets (tests); ``loops=False`` builds the same
        parts but starts no background loop; ``groups`` limits the consumers role to those groups;
        ``room_api`` serves the gRPC room API (with the API role); on Redis leases it is served
        whenever this process builds the command pipeline (module docstring).
        """
        chosen = frozenset(roles)
        unknown = chosen - ROLES
        if unknown:
            raise ValueError(f"unknown roles {sorted(unknown)}; known: {sorted(ROLES)}")
        if not settings.outbox_worker.enabled:
            chosen -= {OUTBOX}
        database = settings.database
        async with (
            opened_database(
                database.connect_url(),
                migrate=database.auto_migrate,
                pool_size=database.pool_size,
                max_overflow=database.max_overflow,
                echo=database.echo,
                timeout_s=database.timeout.total_seconds(),
            ) as db,
            AsyncExitStack() as stack,
        ):
            stack.enter_context(
                tracing.installed(
                    settings.tracing,
                    data_dir=settings.data_dir,
                    resource_attributes={"roomservice.roles": ",".join(sorted(chosen))},
                )
            )
            core = Core(settings=settings, db=db, clock=clock, stack=stack)
            process = await cls._build(core, chosen, wallet=wallet, publishers=publishers or {}, groups=groups)
            _warn_single_owner(settings, chosen, db.dialect_name)
            takes_redis_leases = process.commands is not None and process.commands.redis_leases is not None
            if (room_api and API in chosen) or takes_redis_leases:
                await process._start_room_api()
            if loops:
                process._start()
            _log.info(
                "process_started",
                roles=sorted(chosen),
                database=db.dialect_name,
                publish_mode=settings.outbox_worker.publish_mode,
                targets=sorted(process.worker.publishers.names) if process.worker else [],
            )
            try:
                yield process
            finally:
                await process._stop()

    @classmethod
    async def _build(
        cls,
        core: Core,
        roles: frozenset[str],
        *,
        wallet: Wallet | None,
        publishers: Mapping[str, Publisher],
        groups: frozenset[str] | None,
    ) -> Process:
        process = cls(core=core, roles=roles)
        settings = core.settings
        core.health.register("database", SqlRoomStore(core.db).ping)
        specs = [
            s for s in consumer_groups(settings) if CONSUMERS in roles and (groups is None or s.group in groups)
        ]
        if roles & {API, TIMERS, MAINTENANCE} or needs_commands(settings, specs):
            process.commands = await build_commands(core, wallet=wallet)
        if needs_im(settings, roles, specs, publishers):
            process.im = await start_im(core)
        if (OUTBOX in roles and publishes_to_broker(settings)) or specs:
            process.broker = await open_broker(settings, db=core.db, clock=core.clock, stack=core.stack)
            core.health.register("broker", broker_check(process.broker), critical=False)
        owner = new_owner()
        repository = SqlOutboxRepository(core.db)
        if roles & {OUTBOX, TIMERS, MAINTENANCE}:
            process.treasure_timer = DatabaseTreasureTimer(core.db, clock=core.clock, owner=owner)
        if OUTBOX in roles:
            assert process.treasure_timer is not None
            process.worker, process.direct = await build_outbox_worker(
                core,
                owner=owner,
                repository=repository,
                timer=process.treasure_timer,
                broker=process.broker,
                im=process.im,
                publishers=publishers,
            )
            if process.commands is not None:
                process.commands.service.on_outbox_commit.append(process.worker.wake)
        if process.commands is not None and process.im is not None and API in roles:
            process.commands.service.groups = process.im.publisher  # CreateRoom creates the IM group synchronously
        worker = process.worker
        process.outbox_admin = OutboxAdmin(core.db, clock=core.clock, on_requeued=worker.wake if worker else None)
        if TIMERS in roles:
            assert process.treasure_timer is not None and process.commands is not None
            process.timer_runner = TreasureTimerRunner(
                process.treasure_timer,
                process.commands.forwarder.execute,  # a wake-up of a room another process holds goes there
                idle_s=core.settings.outbox_worker.poll_interval.total_seconds(),
            )
            process.treasure_timer.on_scheduled = process.timer_runner.wake
        if MAINTENANCE in roles:
            assert process.commands is not None and process.treasure_timer is not None
            process.maintenance = build_maintenance(
                core,
                commands=process.commands,
                repository=repository,
                timer=process.treasure_timer,
                outbox_admin=process.outbox_admin,
                broker=process.broker,
            )
        if specs:
            assert process.broker is not None
            process.consumers = build_consumers(
                core, broker=process.broker, commands=process.commands, im=process.im, specs=specs
            )
        return process

    async def _start_room_api(self) -> None:
        commands = self._commands()
        grpc_cfg = self.settings.grpc
        self.room_api = await start_room_api(
            commands.service, host=grpc_cfg.host, port=grpc_cfg.port, servicer=commands.forwarder.servicer()
        )
        advertised = grpc_cfg.advertise_address or format_target(_reachable_host(grpc_cfg.host), self.room_api.port)
        if commands.redis_leases is not None:
            commands.redis_leases.address = advertised
        _log.info("room_api_advertised", address=advertised, lease_driver=self.settings.lease.driver)

    def _start(self) -> None:
        core = self.core
        if self.worker is not None:
            start_outbox_worker(core, self.worker)
        if self.timer_runner is not None:
            core.spawn("treasure-timer", self.timer_runner.run())
        if self.commands is not None:
            self.commands.start(core)
        if self.maintenance is not None:
            self.maintenance.start(core)
        if self.consumers is not None:
            start_consumers(core, self.consumers)

    async def _stop(self) -> None:
        if self.room_api is not None:
            await self.room_api.stop(grace=1.0)
        if self.timer_runner is not None:
            self.timer_runner.stop()
        grace_s = self.settings.outbox_worker.publish_timeout.total_seconds()
        try:
            if self.consumers is not None:  # deliveries in flight finish; the rest come back after visibility
                await self.consumers.shutdown(grace_s=grace_s)
            if self.worker is not None:
                # hands unfinished claims back so another process can take them at once
                await self.worker.shutdown(grace_s=grace_s)
        except Exception as exc:  # the claims then wait out their lease; stopping goes on
            _log.warning("outbox_claims_not_released", error=repr(exc))
        finally:
            await self.core.cancel_tasks()
            if self.commands is not None:
                await self.commands.stop()
            _log.info("process_stopped", roles=sorted(self.roles))


def _reachable_host(host: str) -> str:
    """The host others reach a server bound to ``host`` at (a wildcard bind: this machine's name)."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return host


def _warn_single_owner(settings: Settings, roles: frozenset[str], dialect: str) -> None:
    """Several processes serving commands need Redis leases; say so where it cannot be checked."""
    if API in roles and settings.lease.driver == "inprocess" and dialect != "sqlite":
        _log.warning(
            "single_process_leases",
            message=(
                "lease.driver is inprocess on a shared database: run exactly one process serving commands, "
                "or set lease.driver: redis; other processes cannot be detected reliably, and two owners of a "
                "room fence each other off (503 retry) instead of sharing it"
            ),
            database=dialect,
        )
