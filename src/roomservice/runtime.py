"""The composition root: builds every part from Settings, runs the background loops, stops cleanly."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx

from roomservice.activity.service import RunningActivityService, running_activity_service
from roomservice.admin.operations import OutboxAdmin
from roomservice.cell.registry import CellRegistry
from roomservice.clock import wall_clock_ms
from roomservice.config import Settings
from roomservice.health import HealthChecks
from roomservice.integrations.im_sandbox.server import RunningSandbox, running_sandbox
from roomservice.integrations.tencent_im.client import TencentImClient
from roomservice.leases.inprocess import InProcessLeases
from roomservice.leases.maintenance import DatabaseMaintenanceLock
from roomservice.leases.port import LeaseManager
from roomservice.observability.logging import get_logger
from roomservice.observability.metrics import OUTBOX_BACKLOG, OUTBOX_OLDEST_PENDING_SECONDS
from roomservice.outbox.model import ACTIVITY, IM, TREASURE_WAKEUP, PublishMode
from roomservice.outbox.policy import RetryPolicy
from roomservice.outbox.retention import RetentionSweeper
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.outbox.worker import OutboxWorker, WorkerOptions, new_owner
from roomservice.projections.port import InProcessProjections, RoomListEntry
from roomservice.publishers.activity import ActivityPublisher
from roomservice.publishers.port import Publisher, PublisherSet
from roomservice.publishers.tencent_im import SentSteps, TencentImPublisher
from roomservice.publishers.treasure_wakeup import TreasureWakeupPublisher
from roomservice.service import RoomService, ServiceOptions
from roomservice.store.database import Database
from roomservice.store.migrate import opened_database
from roomservice.store.sql import SqlRoomStore
from roomservice.timers.treasure import DatabaseTreasureTimer, TreasureTimerRunner
from roomservice.wallet.embedded import EmbeddedWallet
from roomservice.wallet.http import HttpWallet
from roomservice.wallet.journal import DebitJournal
from roomservice.wallet.port import Wallet
from roomservice.wallet.reconcile import Reconciler

_log = get_logger("roomservice.runtime")

PROJECTION_SEED_LIMIT = 10_000
EMBEDDED_SDK_APP_ID = 1_400_000_000  # the in-process IM sandbox's app when none is configured


@dataclass(slots=True)
class Runtime:
    settings: Settings
    db: Database
    store: SqlRoomStore
    leases: LeaseManager
    registry: CellRegistry
    wallet: Wallet
    reconciler: Reconciler
    service: RoomService
    health: HealthChecks
    outbox_admin: OutboxAdmin
    treasure_timer: DatabaseTreasureTimer
    timer_runner: TreasureTimerRunner
    retention: RetentionSweeper
    worker: OutboxWorker | None = None
    # in-process helpers of the embedded mode (None when configured to external services)
    sandbox: RunningSandbox | None = None
    activity_service: RunningActivityService | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(_report_crash)
        self.tasks.append(task)

    @classmethod
    @asynccontextmanager
    async def running(
        cls,
        settings: Settings,
        *,
        clock: Callable[[], int] = wall_clock_ms,
        wallet: Wallet | None = None,
        publishers: dict[str, Publisher] | None = None,
        background: bool = True,
    ) -> AsyncIterator[Runtime]:
        """Start everything ``settings`` describes; stop it all on exit.

        ``wallet`` replaces the configured wallet and ``publishers`` adds or
        replaces delivery targets (tests); ``background=False`` skips every
        loop (outbox worker, treasure timer, eviction, reconciliation,
        retention) for tests that drive them by hand.
        """
        database = settings.database
        async with (
            opened_database(
                database.connect_url(),
                migrate=database.auto_migrate,
                pool_size=database.pool_size,
                max_overflow=database.max_overflow,
                echo=database.echo,
            ) as db,
            AsyncExitStack() as stack,
        ):
            targets = dict(publishers or {})
            health_checks: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {}
            helpers: dict[str, Any] = {}
            if background:  # in-process services only where loops will use them
                await _start_direct_targets(settings, db, stack, targets, health_checks, helpers, clock=clock)
            if wallet is None and settings.wallet.driver == "http":
                wallet = await stack.enter_async_context(HttpWallet.from_config(settings.wallet))
            runtime = await cls._build(settings, db, clock=clock, wallet=wallet, publishers=targets)
            for name, check in health_checks.items():
                runtime.health.register(name, check)
            runtime.sandbox = helpers.get("sandbox")
            runtime.activity_service = helpers.get("activity_service")
            im = targets.get(IM)
            if isinstance(im, TencentImPublisher):  # CreateRoom creates the group synchronously too
                runtime.service.groups = im
            async with runtime._running(background=background):
                yield runtime

    @asynccontextmanager
    async def _running(self, *, background: bool) -> AsyncIterator[None]:
        settings = self.settings
        if background:
            self._start_loops()
        _log.info(
            "runtime_started",
            database=self.db.dialect_name,
            publish_mode=settings.outbox_worker.publish_mode,
            wallet=type(self.wallet).__name__,
            targets=sorted(self.worker.publishers.names) if self.worker else [],
        )
        try:
            yield
        finally:
            await self._stop()

    @classmethod
    async def _build(
        cls,
        settings: Settings,
        db: Database,
        *,
        clock: Callable[[], int],
        wallet: Wallet | None,
        publishers: dict[str, Publisher],
    ) -> Runtime:
        store = SqlRoomStore(db)
        leases = InProcessLeases()
        registry = CellRegistry(store=store, leases=leases, idle_after_s=settings.room.idle_evict_after.total_seconds())
        if wallet is None:
            wallet = EmbeddedWallet(db, starting_balance=settings.wallet.starting_balance, clock=clock)
        journal = DebitJournal(db)
        reconciler = Reconciler(
            journal=journal,
            wallet=wallet,
            store=store,
            reconcile_after_ms=int(settings.wallet.reconcile_after.total_seconds() * 1000),
            clock=clock,
            room_turn=registry.holding,
        )
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
            clock=clock,
        )
        health = HealthChecks()
        health.register("database", store.ping)

        outbox = settings.outbox_worker
        owner = new_owner()
        treasure_timer = DatabaseTreasureTimer(db, clock=clock, owner=owner)
        timer_runner = TreasureTimerRunner(treasure_timer, service.execute, idle_s=outbox.poll_interval.total_seconds())
        treasure_timer.on_scheduled = timer_runner.wake
        repository = SqlOutboxRepository(db)
        worker = None
        if outbox.enabled:
            targets: dict[str, Publisher] = {TREASURE_WAKEUP: TreasureWakeupPublisher(treasure_timer)}
            targets.update(publishers)
            worker = OutboxWorker(
                repository=repository,
                publishers=PublisherSet(targets),
                policy=RetryPolicy(
                    initial_backoff_ms=_ms(outbox.initial_backoff),
                    max_backoff_ms=_ms(outbox.max_backoff),
                    max_retry_count=outbox.max_retry_count,
                    jitter=outbox.jitter,
                ),
                options=WorkerOptions(
                    mode=PublishMode(outbox.publish_mode),
                    batch_size=outbox.batch_size,
                    poll_interval_s=outbox.poll_interval.total_seconds(),
                    publish_timeout_s=outbox.publish_timeout.total_seconds(),
                    lock_timeout_s=outbox.lock_timeout.total_seconds(),
                    publish_concurrency=outbox.publish_concurrency,
                ),
                clock=clock,
                owner=owner,
            )
            service.on_outbox_commit.append(worker.wake)
        outbox_admin = OutboxAdmin(db, clock=clock, on_requeued=worker.wake if worker else None)
        retention = RetentionSweeper(
            DatabaseMaintenanceLock(db),
            [repository.delete_delivered, treasure_timer.purge_fired],
            retention_ms=_ms(outbox.delivered_retention),
            batch_size=outbox.retention_batch_size,
            clock=clock,
        )
        return cls(
            settings=settings,
            db=db,
            store=store,
            leases=leases,
            registry=registry,
            wallet=wallet,
            reconciler=reconciler,
            service=service,
            health=health,
            outbox_admin=outbox_admin,
            treasure_timer=treasure_timer,
            timer_runner=timer_runner,
            retention=retention,
            worker=worker,
        )

    def _start_loops(self) -> None:
        if self.worker is not None:
            worker = self.worker
            task = worker.start()
            task.add_done_callback(_report_crash)
            self.tasks.append(task)
            self.health.register("outbox_worker", _alive_check("outbox worker", lambda: worker.alive))
        self.spawn("treasure-timer", self.timer_runner.run())
        self.spawn("outbox-retention", self.retention.run(interval_s=60.0))
        self.spawn("command-log-retention", self._prune_command_log(interval_s=300.0))
        self.spawn("outbox-backlog-metrics", self._sample_backlog(interval_s=15.0))
        room = self.settings.room
        evict_every = max(1.0, min(60.0, room.idle_evict_after.total_seconds() / 4))
        self.spawn("cell-eviction", self.registry.run_eviction(interval_s=evict_every))
        self.spawn(
            "wallet-reconcile",
            self.reconciler.run(interval_s=self.settings.wallet.reconcile_interval.total_seconds()),
        )

    async def _prune_command_log(self, *, interval_s: float, batch_size: int = 1000) -> None:
        """Drop idempotency records older than room.idempotency_retention, in bounded batches."""
        retention_ms = _ms(self.settings.room.idempotency_retention)
        while True:
            try:
                before = self.service.clock() - retention_ms
                for _ in range(100):  # bounded per pass; the next pass continues
                    if await self.store.prune_command_log(before_ms=before, batch_size=batch_size) < batch_size:
                        break
            except Exception as exc:
                _log.warning("command_log_prune_failed", error=repr(exc))
            await asyncio.sleep(interval_s)

    async def _sample_backlog(self, *, interval_s: float) -> None:
        while True:
            try:
                stats = await self.outbox_admin.stats()
                for status, count in stats.counts.items():
                    OUTBOX_BACKLOG.labels(status).set(count)
                OUTBOX_OLDEST_PENDING_SECONDS.set((stats.oldest_pending_age_ms or 0) / 1000)
            except Exception as exc:
                _log.warning("outbox_backlog_sample_failed", error=repr(exc))
            await asyncio.sleep(interval_s)

    async def _stop(self) -> None:
        self.timer_runner.stop()
        try:
            if self.worker is not None:
                # hands unfinished claims back so another process can take them at once
                await self.worker.shutdown(grace_s=self.settings.outbox_worker.publish_timeout.total_seconds())
        except Exception as exc:  # the claims then wait out their lease; stopping goes on
            _log.warning("outbox_claims_not_released", error=repr(exc))
        finally:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            await self.registry.close()
            _log.info("runtime_stopped")


async def _start_direct_targets(
    settings: Settings,
    db: Database,
    stack: AsyncExitStack,
    targets: dict[str, Publisher],
    health: dict[str, Callable[[], Coroutine[Any, Any, None]]],
    helpers: dict[str, Any],
    *,
    clock: Callable[[], int],
) -> None:
    """Publishers of the direct mode, and the in-process services they talk to in the embedded
    mode (an empty ``activity.target`` runs the reference activity service here)."""
    outbox = settings.outbox_worker
    if not outbox.enabled or outbox.publish_mode not in ("direct", "dual"):
        return
    if IM not in targets and settings.tencent_im.enabled:
        targets[IM] = await _start_im(settings, db, stack, health, helpers, clock=clock)
    if ACTIVITY not in targets:
        target = settings.activity.target
        if not target:
            service = await stack.enter_async_context(running_activity_service(db, clock=clock))
            helpers["activity_service"] = service
            target = service.target
            health["activity_service"] = _alive_check("activity service", lambda: service.serving)
        publisher = ActivityPublisher(target)
        stack.push_async_callback(publisher.close)
        targets[ACTIVITY] = publisher


async def _start_im(
    settings: Settings,
    db: Database,
    stack: AsyncExitStack,
    health: dict[str, Callable[[], Coroutine[Any, Any, None]]],
    helpers: dict[str, Any],
    *,
    clock: Callable[[], int],
) -> TencentImPublisher:
    """The Tencent IM publisher; an empty ``tencent_im.base_url`` serves an IM sandbox in
    process (its app id and key made up at start) so a newcomer sees messages without
    credentials."""
    config = settings.tencent_im
    if config.base_url:
        client = TencentImClient.from_config(config)
    else:
        sdk_app_id = config.sdk_app_id or EMBEDDED_SDK_APP_ID
        secret = config.secret_key.get_secret_value() or secrets.token_hex(32)
        sandbox = await stack.enter_async_context(
            running_sandbox(sdk_app_id, secret, admin_identifiers=(config.admin_identifier,))
        )
        client = TencentImClient.from_config(
            config,
            base_url=sandbox.base_url,
            sdk_app_id=sdk_app_id,
            secret_key=secret,
            transport=sandbox.transport(),
        )
        helpers["sandbox"] = sandbox
        health["im_sandbox"] = _http_check(f"{sandbox.base_url}/_sandbox/healthz", sandbox.transport())
        _log.info("im_sandbox_started", url=sandbox.base_url, sdk_app_id=sdk_app_id)
    stack.push_async_callback(client.aclose)
    return TencentImPublisher(client, SentSteps(db, clock=clock), group_type=config.group_type)


def _http_check(url: str, transport: httpx.AsyncBaseTransport | None) -> Callable[[], Coroutine[Any, Any, None]]:
    async def check() -> None:
        async with httpx.AsyncClient(transport=transport, timeout=2.0) as http:
            (await http.get(url)).raise_for_status()

    return check


def _ms(value: timedelta) -> int:
    return int(value.total_seconds() * 1000)


def _alive_check(name: str, alive: Callable[[], bool]) -> Callable[[], Coroutine[Any, Any, None]]:
    async def check() -> None:
        if not alive():
            raise RuntimeError(f"{name} is not running")

    return check


def _report_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        _log.error("background_task_crashed", task=task.get_name(), error=repr(task.exception()))
