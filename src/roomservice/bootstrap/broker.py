"""Opening the configured broker (``broker.driver``) for the roles and commands that need one.

A process opens a broker when it publishes the outbox to it (``mq``/``dual``),
schedules treasure wake-ups as delay messages, or consumes a group. A broker
that does not answer keeps the process ready (commands still succeed, seed
row 3): ``/readyz`` shows it as degraded, and ``room_broker_up`` says 0.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

from roomservice.bootstrap.core import Check, ms
from roomservice.brokers.port import Broker
from roomservice.config import Settings
from roomservice.observability.logging import get_logger
from roomservice.observability.metrics import BROKER_UP
from roomservice.store.database import Database

_log = get_logger("roomservice.bootstrap")


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A consumer group this configuration runs: its topic and how many deliveries before the dead letter."""

    group: str
    topic: str
    max_deliveries: int


def consumer_groups(settings: Settings) -> list[GroupSpec]:
    """The groups this configuration enables, each with its own switch."""
    mq = settings.rocketmq
    outbox = mq.room_outbox
    outbox_max = 1 + outbox.consumer_max_reconsume_times
    groups = []
    if settings.consumers.activity.enabled:
        groups.append(GroupSpec(settings.consumers.activity.group, outbox.topic, outbox_max))
    if settings.consumers.notice.enabled:
        groups.append(GroupSpec(settings.consumers.notice.group, outbox.topic, outbox_max))
    if outbox.tencent_im_consumer_enabled:
        groups.append(GroupSpec(outbox.tencent_im_consumer_group, outbox.topic, outbox_max))
    if mq.treasure_open.enabled:
        t = mq.treasure_open
        groups.append(GroupSpec(t.consumer_group, t.topic, 1 + t.consumer_max_reconsume_times))
    return groups


def publishes_to_broker(settings: Settings) -> bool:
    return settings.outbox_worker.publish_mode in ("mq", "dual") or settings.rocketmq.treasure_open.enabled


def retry_horizon_ms(settings: Settings) -> int:
    """How long the outbox worker may keep re-publishing one row: every backoff (at the jitter's upper bound)
    plus every attempt's claim. The NATS duplicate window must cover it, or a late retry is stored twice."""
    outbox = settings.outbox_worker
    total = ms(outbox.lock_timeout)
    for attempt in range(1, outbox.max_retry_count + 1):
        backoff = min(ms(outbox.max_backoff), ms(outbox.initial_backoff) * 2 ** min(attempt - 1, 40))
        total += int(backoff * (1 + outbox.jitter)) + ms(outbox.lock_timeout)
    return total


async def open_broker(settings: Settings, *, db: Database, clock: Callable[[], int], stack: AsyncExitStack) -> Broker:
    """The configured broker, closed when ``stack`` closes."""
    config = settings.broker
    broker: Broker
    if config.driver == "embedded":
        from roomservice.brokers.embedded import EmbeddedBroker

        broker = EmbeddedBroker(db, config=config.embedded, clock=clock)
    elif config.driver == "nats":
        from roomservice.brokers.nats import open_nats_broker

        window_s = max(config.nats.duplicate_window.total_seconds(), retry_horizon_ms(settings) / 1000)
        broker = await open_nats_broker(
            config.nats, subject_prefix=settings.rocketmq.namespace, duplicate_window_s=window_s
        )
    else:
        from roomservice.brokers.rocketmq import open_rocketmq_broker

        broker = await open_rocketmq_broker(settings.rocketmq, clock=clock)
    stack.push_async_callback(broker.close)
    _log.info("broker_opened", driver=config.driver)
    return broker


def broker_check(broker: Broker) -> Check:
    """The broker's ping for /readyz (registered as non-critical) and the ``room_broker_up`` gauge."""

    async def check() -> None:
        try:
            await broker.ping()
        except BaseException:
            BROKER_UP.set(0)
            raise
        BROKER_UP.set(1)

    return check
