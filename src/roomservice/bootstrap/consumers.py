"""The consumers role: the consumer runtime with every group this configuration enables."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from roomservice.activity.store import ActivityStore
from roomservice.bootstrap.broker import GroupSpec
from roomservice.bootstrap.commands import Commands
from roomservice.bootstrap.core import Core, alive_check
from roomservice.bootstrap.direct import ImParts
from roomservice.brokers.port import Broker
from roomservice.config import Settings
from roomservice.consumers.activity import ActivityHandler
from roomservice.consumers.im_bridge import ImBridgeHandler
from roomservice.consumers.notice import NoticeHandler
from roomservice.consumers.runtime import ConsumerRuntime, GroupOptions, Handler
from roomservice.consumers.treasure_open import TreasureOpenHandler
from roomservice.outbox.model import IM
from roomservice.outbox.policy import RetryPolicy


def needs_commands(settings: Settings, specs: Sequence[GroupSpec]) -> bool:
    """Whether a group this process runs sends commands to rooms (the treasure-open group does)."""
    return any(spec.group == settings.rocketmq.treasure_open.consumer_group for spec in specs)


def needs_im(
    settings: Settings, roles: frozenset[str], specs: Sequence[GroupSpec], given: Mapping[str, object]
) -> bool:
    """Whether this process talks to Tencent IM: direct publishing, the IM bridge or the notice group."""
    from roomservice.bootstrap.process import OUTBOX

    if not settings.tencent_im.enabled:
        return False
    direct = OUTBOX in roles and settings.outbox_worker.publish_mode in ("direct", "dual") and IM not in given
    names = {spec.group for spec in specs}
    bridge = settings.rocketmq.room_outbox.tencent_im_consumer_group in names
    notice = settings.consumers.notice.group in names
    return direct or bridge or notice


def build_consumers(
    core: Core, *, broker: Broker, commands: Commands | None, im: ImParts | None, specs: Sequence[GroupSpec]
) -> ConsumerRuntime:
    settings = core.settings
    mq = settings.rocketmq
    publish_timeout_s = settings.outbox_worker.publish_timeout.total_seconds()
    groups: list[tuple[Handler, GroupOptions]] = []
    for spec in specs:
        handler: Handler
        if spec.group == mq.treasure_open.consumer_group:
            if commands is None:
                raise ValueError("the treasure-open group needs the command pipeline")
            handler = TreasureOpenHandler(
                commands.forwarder.execute, group=spec.group, topic=spec.topic, clock=core.clock
            )
        elif spec.group == settings.consumers.activity.group:
            handler = ActivityHandler(ActivityStore(core.db, clock=core.clock), group=spec.group, topic=spec.topic)
        elif spec.group == settings.consumers.notice.group:
            handler = NoticeHandler(
                core.db,
                _im(im, spec).client,
                group=spec.group,
                topic=spec.topic,
                clock=core.clock,
                sender=settings.tencent_im.admin_identifier,
            )
        elif spec.group == mq.room_outbox.tencent_im_consumer_group:
            handler = ImBridgeHandler(
                _im(im, spec).publisher,
                group=spec.group,
                topic=spec.topic,
                clock=core.clock,
                publish_timeout_s=publish_timeout_s,
                max_deliveries=spec.max_deliveries,
            )
        else:  # pragma: no cover - consumer_groups lists only groups with a handler here
            raise ValueError(f"no handler for consumer group {spec.group}")
        ordered = spec.group == mq.room_outbox.tencent_im_consumer_group  # a room's IM messages in order
        groups.append((handler, _options(spec, core, ordered_by_key=ordered)))
    return ConsumerRuntime(broker, groups)


def _im(im: ImParts | None, spec: GroupSpec) -> ImParts:
    if im is None:
        raise ValueError(f"consumer group {spec.group} needs Tencent IM (tencent_im.enabled is false)")
    return im


def _options(spec: GroupSpec, core: Core, *, ordered_by_key: bool) -> GroupOptions:
    consumers = core.settings.consumers
    # a delivery not acked by then comes back (unset: twice the publish deadline, the longest an effect should take)
    visibility_s = consumers.visibility(core.settings.outbox_worker.publish_timeout).total_seconds()
    backoff = RetryPolicy(
        initial_backoff_ms=round(consumers.initial_backoff.total_seconds() * 1000),
        max_backoff_ms=round(consumers.max_backoff.total_seconds() * 1000),
        max_retry_count=1 << 30,  # the broker counts deliveries and dead-letters; the policy only spaces them
    )
    return GroupOptions(
        max_deliveries=spec.max_deliveries, visibility_s=visibility_s, ordered_by_key=ordered_by_key, backoff=backoff
    )


def start_consumers(core: Core, runtime: ConsumerRuntime) -> None:
    for task in runtime.start():
        core.track(task)
    core.health.register("consumers", alive_check("consumer groups", lambda: runtime.alive))
    core.spawn("consumer-stats", _sample(runtime))


async def _sample(runtime: ConsumerRuntime, interval_s: float = 15.0) -> None:
    while True:
        await runtime.sample_stats()
        await asyncio.sleep(interval_s)
