"""The outbox role: the worker and its publishers. It needs no Room Cells, reconciler or projections."""

from __future__ import annotations

from collections.abc import Mapping

from roomservice.bootstrap.core import Core, ms
from roomservice.bootstrap.direct import DirectTargets, ImParts, build_direct_targets
from roomservice.brokers.port import Broker
from roomservice.outbox.model import BROKER, TREASURE_WAKEUP, PublishMode
from roomservice.outbox.policy import RetryPolicy
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.outbox.worker import OutboxWorker, WorkerOptions
from roomservice.publishers.broker import BrokerPublisher
from roomservice.publishers.port import Publisher, PublisherSet
from roomservice.publishers.treasure_wakeup import TreasureWakeupPublisher
from roomservice.timers.delay_message import DelayMessageScheduler
from roomservice.timers.port import TreasureScheduler


async def build_outbox_worker(
    core: Core,
    *,
    owner: str,
    repository: SqlOutboxRepository,
    timer: TreasureScheduler,
    broker: Broker | None,
    im: ImParts | None,
    publishers: Mapping[str, Publisher],
) -> tuple[OutboxWorker, DirectTargets]:
    """The worker with every target its publish mode needs; ``publishers`` add or replace targets (tests).

    Countdowns go to the broker as delay messages when ``rocketmq.treasure_open.enabled``, else to ``timer``
    (the durable database timer)."""
    settings = core.settings
    outbox = settings.outbox_worker
    mq = settings.rocketmq
    mode = PublishMode(outbox.publish_mode)
    direct = DirectTargets()
    if mode in (PublishMode.DIRECT, PublishMode.DUAL):
        direct = await build_direct_targets(core, im=im, skip=frozenset(publishers))
    scheduler = timer
    targets: dict[str, Publisher] = dict(direct.publishers)
    if broker is not None:
        if mode in (PublishMode.MQ, PublishMode.DUAL):
            targets[BROKER] = BrokerPublisher(broker, topic=mq.room_outbox.topic)
        if mq.treasure_open.enabled:
            scheduler = DelayMessageScheduler(
                broker, topic=mq.treasure_open.topic, publish_timeout_s=outbox.publish_timeout.total_seconds()
            )
    targets[TREASURE_WAKEUP] = TreasureWakeupPublisher(scheduler)
    targets.update(publishers)
    worker = OutboxWorker(
        repository=repository,
        publishers=PublisherSet(targets),
        policy=RetryPolicy(
            initial_backoff_ms=ms(outbox.initial_backoff),
            max_backoff_ms=ms(outbox.max_backoff),
            max_retry_count=outbox.max_retry_count,
            jitter=outbox.jitter,
        ),
        options=WorkerOptions(
            mode=mode,
            batch_size=outbox.batch_size,
            poll_interval_s=outbox.poll_interval.total_seconds(),
            publish_timeout_s=outbox.publish_timeout.total_seconds(),
            lock_timeout_s=outbox.lock_timeout.total_seconds(),
            publish_concurrency=outbox.publish_concurrency,
            database_timeout_s=core.settings.database.timeout.total_seconds(),
        ),
        clock=core.clock,
        owner=owner,
    )
    return worker, direct


def start_outbox_worker(core: Core, worker: OutboxWorker) -> None:
    core.track(worker.start())
    core.health.register("outbox_worker", worker.check)  # stopped, stuck or failing: not ready
