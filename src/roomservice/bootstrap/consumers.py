"""The consumers role: the consumer runtime with every group this configuration enables."""

from __future__ import annotations

from collections.abc import Sequence

from roomservice.bootstrap.broker import GroupSpec
from roomservice.bootstrap.commands import Commands
from roomservice.bootstrap.core import Core, alive_check
from roomservice.brokers.port import Broker
from roomservice.consumers.runtime import ConsumerRuntime, GroupOptions, Handler
from roomservice.consumers.treasure_open import TreasureOpenHandler


def needs_commands(core: Core) -> bool:
    """Whether an enabled group sends commands to rooms (the treasure-open group does)."""
    return core.settings.rocketmq.treasure_open.enabled


def build_consumers(
    core: Core, *, broker: Broker, commands: Commands | None, specs: Sequence[GroupSpec]
) -> ConsumerRuntime:
    mq = core.settings.rocketmq
    groups: list[tuple[Handler, GroupOptions]] = []
    for spec in specs:
        if spec.group == mq.treasure_open.consumer_group:
            if commands is None:
                raise ValueError("the treasure-open group needs the command pipeline")
            handler: Handler = TreasureOpenHandler(
                commands.service.execute, group=spec.group, topic=spec.topic, clock=core.clock
            )
        else:  # pragma: no cover - every enabled group has a handler above
            raise ValueError(f"no handler for consumer group {spec.group}")
        groups.append((handler, _options(spec, core)))
    return ConsumerRuntime(broker, groups)


def _options(spec: GroupSpec, core: Core) -> GroupOptions:
    # a delivery not acked within twice the publish deadline (the longest an effect should take) comes back
    visibility_s = max(5.0, 2 * core.settings.outbox_worker.publish_timeout.total_seconds())
    return GroupOptions(max_deliveries=spec.max_deliveries, visibility_s=visibility_s)


def start_consumers(core: Core, runtime: ConsumerRuntime) -> None:
    for task in runtime.start():
        core.track(task)
    core.health.register("consumers", alive_check("consumer groups", lambda: runtime.alive))
    core.spawn("consumer-stats", _sample(runtime))


async def _sample(runtime: ConsumerRuntime, interval_s: float = 15.0) -> None:
    import asyncio

    while True:
        await runtime.sample_stats()
        await asyncio.sleep(interval_s)
