"""The consumer runtime on the in-memory broker: ack, nack with backoff, dead letters, outages, shutdown."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio
from structlog.contextvars import merge_contextvars
from structlog.testing import capture_logs

from roomservice.brokers.fake import FakeBroker
from roomservice.brokers.port import Delivery, OutgoingMessage
from roomservice.consumers import runtime as runtime_module
from roomservice.consumers.runtime import ConsumerRuntime, GroupOptions, Outcome, Redeliver, _finished
from roomservice.observability.logging import get_logger
from roomservice.outbox.policy import RetryPolicy

TOPIC = "hyapp_room_outbox"
GROUP = "g-test"
FAST = RetryPolicy(initial_backoff_ms=10, max_backoff_ms=40, max_retry_count=1 << 30, jitter=0.0)


class Recorder:
    """A handler that applies each key once, fails for keys in ``failing``, and can be made to block."""

    def __init__(self, group: str = GROUP) -> None:
        self.group = group
        self.topic = TOPIC
        self.applied: list[str] = []
        self.seen: list[tuple[str, int]] = []
        self.failing: set[str] = set()
        self.early: dict[str, int] = {}  # key -> times to ask for redelivery
        self.block = asyncio.Event()
        self.block.set()
        self.started = asyncio.Event()

    async def handle(self, delivery: Delivery) -> Outcome:
        self.seen.append((delivery.key, delivery.delivery_count))
        self.started.set()
        await self.block.wait()
        if delivery.key in self.failing:
            raise RuntimeError(f"cannot apply {delivery.key}")
        if self.early.get(delivery.key, 0) > 0:
            self.early[delivery.key] -= 1
            raise Redeliver(0.05)
        if delivery.key in self.applied:
            return Outcome.DUPLICATE
        self.applied.append(delivery.key)
        return Outcome.APPLIED


async def until(check: Callable[[], bool | Awaitable[bool]], deadline_s: float = 5.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        result = check()
        if result if isinstance(result, bool) else await result:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


@pytest_asyncio.fixture
async def broker() -> AsyncIterator[FakeBroker]:
    broker = FakeBroker()
    yield broker
    await broker.close()


def options(max_deliveries: int = 3, **kw: object) -> GroupOptions:
    return GroupOptions(max_deliveries=max_deliveries, wait_s=0.05, visibility_s=0.5, backoff=FAST, **kw)  # type: ignore[arg-type]


async def publish(broker: FakeBroker, *keys: str) -> None:
    for key in keys:
        await broker.publish(OutgoingMessage(topic=TOPIC, body=b"x", key=key), timeout_s=1)


async def test_handled_deliveries_are_acked_once(broker: FakeBroker) -> None:
    handler = Recorder()
    runtime = ConsumerRuntime(broker, [(handler, options())])
    runtime.start()
    await publish(broker, "e1", "e2", "e3")
    await until(lambda: len(handler.applied) == 3)
    await until(lambda: _lag(broker, 0))
    await runtime.shutdown(grace_s=1)
    assert sorted(handler.applied) == ["e1", "e2", "e3"]
    assert runtime.runner(GROUP).counts.applied == 3


async def test_a_failing_message_is_dead_lettered_after_the_limit_and_logged_once_per_delivery(
    broker: FakeBroker,
) -> None:
    handler = Recorder()
    handler.failing.add("poison")
    runtime = ConsumerRuntime(broker, [(handler, options(max_deliveries=3))])
    with capture_logs() as logs:
        runtime.start()
        await publish(broker, "poison", "good1", "good2")
        await until(lambda: set(handler.applied) == {"good1", "good2"})
        await until(lambda: _dead(broker, 1))
        await runtime.shutdown(grace_s=1)
    assert [count for key, count in handler.seen if key == "poison"] == [1, 2, 3]
    failed = [e for e in logs if e["event"] == "consumer_delivery_failed"]
    assert [(e["key"], e["delivery_count"], e["dead_letter"]) for e in failed] == [
        ("poison", 1, False),
        ("poison", 2, False),
        ("poison", 3, True),
    ]
    (dead,) = await broker.dead_letters(GROUP)
    assert dead.key == "poison" and "cannot apply poison" in dead.reason
    assert runtime.runner(GROUP).counts.failures == 3


async def test_a_replayed_dead_letter_applies_once_fixed(broker: FakeBroker) -> None:
    handler = Recorder()
    handler.failing.add("e1")
    runtime = ConsumerRuntime(broker, [(handler, options(max_deliveries=1))])
    runtime.start()
    await publish(broker, "e1")
    await until(lambda: _dead(broker, 1))
    handler.failing.clear()
    (dead,) = await broker.dead_letters(GROUP)
    assert await broker.replay_dead_letter(GROUP, dead.message_id)
    await until(lambda: handler.applied == ["e1"])
    await runtime.shutdown(grace_s=1)


async def test_redeliver_asks_again_later_without_counting_a_failure(broker: FakeBroker) -> None:
    handler = Recorder()
    handler.early["box"] = 2
    runtime = ConsumerRuntime(broker, [(handler, options(max_deliveries=5))])
    runtime.start()
    await publish(broker, "box")
    await until(lambda: handler.applied == ["box"])
    await runtime.shutdown(grace_s=1)
    assert [count for _, count in handler.seen] == [1, 2, 3]
    assert runtime.runner(GROUP).counts.failures == 0


async def test_groups_are_independent_and_a_duplicate_is_counted(broker: FakeBroker) -> None:
    activity, notice = Recorder("g-activity"), Recorder("g-notice")
    notice.failing.add("e1")
    runtime = ConsumerRuntime(broker, [(activity, options()), (notice, options(max_deliveries=1))])
    runtime.start()
    await publish(broker, "e1", "e2")
    await until(lambda: sorted(activity.applied) == ["e1", "e2"] and notice.applied == ["e2"])
    await runtime.shutdown(grace_s=1)
    assert len(await broker.dead_letters("g-notice")) == 1 and await broker.dead_letters("g-activity") == []


async def test_the_loop_survives_a_broker_outage(broker: FakeBroker) -> None:
    handler = Recorder()
    runtime = ConsumerRuntime(broker, [(handler, options())])
    broker.down = True
    with capture_logs() as logs:
        runtime.start()
        await until(lambda: any(e["event"] == "consumer_fetch_failed" for e in logs))
        assert runtime.alive
        broker.down = False
        await publish(broker, "after")
        await until(lambda: handler.applied == ["after"])
        await runtime.shutdown(grace_s=1)
    assert sum(e["event"] == "consumer_fetch_failed" for e in logs) < 5  # backs off, no log flood


async def test_shutdown_lets_a_delivery_in_flight_finish(broker: FakeBroker) -> None:
    handler = Recorder()
    handler.block.clear()
    runtime = ConsumerRuntime(broker, [(handler, options())])
    runtime.start()
    await publish(broker, "slow")
    await asyncio.wait_for(handler.started.wait(), 5)
    stopping = asyncio.create_task(runtime.shutdown(grace_s=5))
    await asyncio.sleep(0.05)
    handler.block.set()
    await stopping
    assert handler.applied == ["slow"] and await _lag(broker, 0)


async def test_a_delivery_cut_short_by_shutdown_is_not_acked_and_comes_back(broker: FakeBroker) -> None:
    handler = Recorder()
    handler.block.clear()
    runtime = ConsumerRuntime(broker, [(handler, options())])
    runtime.start()
    await publish(broker, "cut")
    await asyncio.wait_for(handler.started.wait(), 5)
    await runtime.shutdown(grace_s=0.05)
    assert handler.applied == [] and await _lag(broker, 1)
    handler.block.set()
    again = ConsumerRuntime(broker, [(handler, options())])
    again.start()
    await until(lambda: handler.applied == ["cut"])
    await again.shutdown(grace_s=1)
    assert handler.seen[-1] == ("cut", 2)


async def _lag(broker: FakeBroker, n: int) -> bool:
    return (await broker.group_stats(TOPIC, GROUP)).lag == n


async def _dead(broker: FakeBroker, n: int) -> bool:
    return len(await broker.dead_letters(GROUP)) == n


async def test_ordered_by_key_handles_one_rooms_deliveries_in_fetch_order_and_rooms_concurrently(
    broker: FakeBroker,
) -> None:
    order: list[str] = []
    release_r1 = asyncio.Event()

    class Slow:
        group, topic = GROUP, TOPIC

        async def handle(self, delivery: Delivery) -> Outcome:
            if delivery.key == "r1-a":
                await release_r1.wait()  # the room's first message is slow
            order.append(delivery.key)
            return Outcome.APPLIED

    runtime = ConsumerRuntime(broker, [(Slow(), options(ordered_by_key=True))])
    for key, room in [("r1-a", "r1"), ("r1-b", "r1"), ("r2-a", "r2")]:
        await broker.publish(OutgoingMessage(topic=TOPIC, body=b"x", key=key, sharding_key=room), timeout_s=1)
    runtime.start()
    await until(lambda: order == ["r2-a"])  # another room is not held up
    await asyncio.sleep(0.05)
    assert order == ["r2-a"]  # r1-b waits for r1-a
    release_r1.set()
    await until(lambda: order == ["r2-a", "r1-a", "r1-b"])
    await runtime.shutdown(grace_s=1)


async def test_deliveries_waiting_behind_their_room_do_not_come_back_meanwhile(broker: FakeBroker) -> None:
    """ordered_by_key: a room's burst waits in line behind its first message, longer than a visibility
    timeout when the target is slow (IM near its timeout, rate limited). A waiting delivery is touched, so
    it neither comes back to be handled twice nor burns deliveries into a dead letter it never earned."""
    calls: dict[str, int] = {}

    class SlowTarget:
        group, topic = GROUP, TOPIC

        async def handle(self, delivery: Delivery) -> Outcome:
            calls[delivery.key] = calls.get(delivery.key, 0) + 1
            await asyncio.sleep(0.2)  # the target's own time, well under the 0.5 s visibility
            return Outcome.APPLIED

    runtime = ConsumerRuntime(broker, [(SlowTarget(), options(ordered_by_key=True))])
    keys = [f"r1-{n}" for n in range(8)]  # 1.6 s of the room's work in line
    for key in keys:
        await broker.publish(OutgoingMessage(topic=TOPIC, body=b"x", key=key, sharding_key="r1"), timeout_s=1)
    runtime.start()
    await until(lambda: _lag(broker, 0), deadline_s=10)
    assert calls == dict.fromkeys(keys, 1)
    assert runtime.counts()[GROUP]["redelivered"] == 0
    assert await broker.dead_letters(GROUP) == []
    await runtime.shutdown(grace_s=1)


def held_options(**kw: object) -> GroupOptions:
    """A visibility timeout of 1 s: the keep-alive touches at a third of it, so a loaded machine's loop
    would have to stall for half a second before a touch came too late."""
    return GroupOptions(**{"max_deliveries": 3, "wait_s": 0.05, "visibility_s": 1.0, "backoff": FAST, **kw})  # type: ignore[arg-type]


async def test_a_delivery_whose_handler_runs_past_the_visibility_timeout_does_not_come_back(
    broker: FakeBroker,
) -> None:
    """A notice makes two IM calls, each up to the publish timeout: longer than the group's visibility at
    worst. While its handler runs, a delivery is touched, so it is not handed out again meanwhile (to be
    handled twice at once, and counted towards a dead letter)."""
    calls: dict[str, int] = {}
    release = asyncio.Event()

    class Slow:
        group, topic = GROUP, TOPIC

        async def handle(self, delivery: Delivery) -> Outcome:
            calls[delivery.key] = calls.get(delivery.key, 0) + 1
            await release.wait()
            return Outcome.APPLIED

    runtime = ConsumerRuntime(broker, [(Slow(), held_options(max_deliveries=1))])
    runtime.start()
    await publish(broker, "ev-1")
    await until(lambda: calls == {"ev-1": 1})
    started = time.monotonic()
    while time.monotonic() - started < 3 * 1.0:  # three visibility timeouts: any redelivery would be fetched
        assert calls == {"ev-1": 1}
        await asyncio.sleep(0.05)
    release.set()
    await until(lambda: _lag(broker, 0))
    assert calls == {"ev-1": 1} and runtime.counts()[GROUP]["redelivered"] == 0
    assert await broker.dead_letters(GROUP) == []
    await runtime.shutdown(grace_s=1)


@pytest.mark.parametrize("ordered", [False, True])
async def test_a_handler_that_looks_hung_is_cancelled_and_its_delivery_comes_back(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch, ordered: bool
) -> None:
    """Past HUNG_AFTER_TIMEOUTS visibility timeouts of handling the handler is cancelled, with one warning:
    its slot and (ordered_by_key) its room's turn go on, and the delivery comes back to be handled again."""
    monkeypatch.setattr(runtime_module, "HUNG_AFTER_TIMEOUTS", 2)  # 2 s at 1 s visibility
    calls: list[tuple[str, float]] = []
    never = asyncio.Event()

    class Hangs:
        group, topic = GROUP, TOPIC

        async def handle(self, delivery: Delivery) -> Outcome:
            calls.append((delivery.key, time.monotonic()))
            if len(calls) == 1:
                await never.wait()
            return Outcome.APPLIED

    runtime = ConsumerRuntime(broker, [(Hangs(), held_options(concurrency=1, ordered_by_key=ordered))])
    with capture_logs() as logs:
        runtime.start()
        for key in ("ev-1", "ev-2"):  # one room's two messages; one slot
            await broker.publish(OutgoingMessage(topic=TOPIC, body=b"x", key=key, sharding_key="r1"), timeout_s=1)
        await until(lambda: _lag(broker, 0), deadline_s=15)
        await runtime.shutdown(grace_s=1)
    assert sorted(key for key, _ in calls) == ["ev-1", "ev-1", "ev-2"]
    assert calls[1][1] - calls[0][1] >= 2 * 1.0  # held while it looked alive
    assert [e["key"] for e in logs if e["event"] == "consumer_delivery_hung"] == ["ev-1"]


async def test_an_ack_waits_for_a_touch_under_way(broker: FakeBroker) -> None:
    """On RocketMQ a touch gives the delivery a new receipt: an ack sent meanwhile with the old one would be
    refused, and the message handled again. The runtime acks after the touch has answered."""
    order: list[str] = []
    touch_started, finish_touch, handler_done = asyncio.Event(), asyncio.Event(), asyncio.Event()

    class SlowTouch(FakeBroker):
        async def touch(self, delivery: Delivery, *, visibility_s: float) -> None:
            order.append("touch")
            touch_started.set()
            await finish_touch.wait()
            await super().touch(delivery, visibility_s=visibility_s)
            order.append("touched")

        async def ack(self, delivery: Delivery) -> None:
            order.append("ack")
            await super().ack(delivery)

    class WaitsForTouch:
        group, topic = GROUP, TOPIC

        async def handle(self, delivery: Delivery) -> Outcome:
            await touch_started.wait()
            handler_done.set()
            return Outcome.APPLIED

    slow = SlowTouch()
    runtime = ConsumerRuntime(slow, [(WaitsForTouch(), held_options(ack_linger_s=0))])
    runtime.start()
    await slow.publish(OutgoingMessage(topic=TOPIC, body=b"x", key="ev-1"), timeout_s=1)
    await handler_done.wait()
    for _ in range(20):  # the settle has its turns while the touch is held
        await asyncio.sleep(0)
    assert order == ["touch"]
    finish_touch.set()
    await until(lambda: order == ["touch", "touched", "ack"])
    await runtime.shutdown(grace_s=1)
    await slow.close()


async def test_lines_a_handler_logs_name_the_group_and_the_event(broker: FakeBroker) -> None:
    class Talkative:
        group, topic = GROUP, TOPIC

        async def handle(self, delivery: Delivery) -> Outcome:
            get_logger("test").info("handling")
            return Outcome.APPLIED

    runtime = ConsumerRuntime(broker, [(Talkative(), options())])
    with capture_logs(processors=[merge_contextvars]) as logs:
        runtime.start()
        await publish(broker, "ev-1")
        await until(lambda: any(e["event"] == "handling" for e in logs))
        await runtime.shutdown(grace_s=1)
    line = next(e for e in logs if e["event"] == "handling")
    assert (line["consumer_group"], line["event_id"]) == (GROUP, "ev-1")


class CountingFetches(FakeBroker):
    """The in-memory broker, recording what each fetch asked for and got."""

    def __init__(self) -> None:
        super().__init__()
        self.fetches: list[tuple[int, int]] = []  # (max_messages, deliveries)

    async def fetch(
        self, topic: str, group: str, *, max_messages: int, wait_s: float, visibility_s: float
    ) -> list[Delivery]:
        got = await super().fetch(topic, group, max_messages=max_messages, wait_s=wait_s, visibility_s=visibility_s)
        self.fetches.append((max_messages, len(got)))
        return list(got)


async def test_a_fetch_takes_only_what_can_start_and_none_while_every_slot_is_busy() -> None:
    broker = CountingFetches()
    handler = Recorder()
    handler.block.clear()
    runtime = ConsumerRuntime(broker, [(handler, options(concurrency=3, batch_size=32))])
    await publish(broker, *(f"e{i}" for i in range(5)))
    runtime.start()
    await until(lambda: len(handler.seen) == 3)  # every slot busy
    asked_while_busy = len(broker.fetches)
    await asyncio.sleep(0.2)  # several long-polls' worth (wait_s 0.05): a fetch now would show
    assert len(broker.fetches) == asked_while_busy
    stats = await broker.group_stats(TOPIC, GROUP)
    assert (stats.lag, stats.in_flight) == (5, 3)  # no delivery taken out with no slot to run in
    handler.block.set()
    await until(lambda: sorted(handler.applied) == [f"e{i}" for i in range(5)])
    await until(lambda: _lag(broker, 0))
    await runtime.shutdown(grace_s=1)
    assert broker.fetches[0] == (3, 3)  # as many as there were free slots, not batch_size
    assert all(asked <= 3 for asked, _ in broker.fetches)
    assert [count for _, count in handler.seen] == [1] * 5  # nothing waited out its visibility for a slot
    await broker.close()


async def test_one_failing_delivery_of_a_fetched_batch_fails_alone(broker: FakeBroker) -> None:
    handler = Recorder()
    handler.failing.add("e2")
    handler.block.clear()  # all four are fetched together before any is handled
    runtime = ConsumerRuntime(broker, [(handler, options(max_deliveries=2))])
    await publish(broker, "e1", "e2", "e3", "e4")
    runtime.start()
    await until(lambda: len(handler.seen) == 4)
    handler.block.set()
    await until(lambda: sorted(handler.applied) == ["e1", "e3", "e4"])
    await until(lambda: _dead(broker, 1))
    await until(lambda: _lag(broker, 0))  # the others acked, the failing one buried
    await runtime.shutdown(grace_s=1)
    assert [count for key, count in handler.seen if key != "e2"] == [1, 1, 1]  # acked at their first delivery
    assert [count for key, count in handler.seen if key == "e2"] == [1, 2]
    (dead,) = await broker.dead_letters(GROUP)
    assert dead.key == "e2"
    assert runtime.runner(GROUP).counts.applied == 3 and runtime.runner(GROUP).counts.failures == 2


class OneByOne(Recorder):
    """A handler whose deliveries finish only when the test lets them, one at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Semaphore(0)

    async def handle(self, delivery: Delivery) -> Outcome:
        await self.go.acquire()
        return await super().handle(delivery)


async def one_by_one(messages: int, refill_wait_s: float) -> tuple[CountingFetches, OneByOne, ConsumerRuntime]:
    """A group of 8 slots whose first fetch took 8 of ``messages`` deliveries, none finished yet."""
    broker = CountingFetches()
    handler = OneByOne()
    runtime = ConsumerRuntime(broker, [(handler, options(concurrency=8, batch_size=8, refill_wait_s=refill_wait_s))])
    await publish(broker, *(f"e{i}" for i in range(messages)))
    runtime.start()
    await until(lambda: broker.fetches == [(8, 8)])
    return broker, handler, runtime


async def test_while_deliveries_are_in_flight_a_fetch_waits_for_half_the_slots_not_one() -> None:
    broker, handler, runtime = await one_by_one(24, refill_wait_s=30)
    for n in range(1, 17):  # freed one by one, as a rate limit frees the IM bridge's
        handler.go.release()
        await until(lambda n=n: len(handler.applied) == n)  # type: ignore[misc]
    await until(lambda: len(broker.fetches) == 5)
    assert broker.fetches[1:] == [(4, 4)] * 4  # one fetch per four freed slots, not one per slot
    for _ in range(8):  # the rest finish; with none in flight a fetch waits for nothing
        handler.go.release()
    await until(lambda: len(handler.applied) == 24 and _lag(broker, 0))
    await runtime.shutdown(grace_s=1)
    await broker.close()


async def test_a_fetch_waits_for_freed_slots_no_longer_than_refill_wait_s() -> None:
    broker, handler, runtime = await one_by_one(9, refill_wait_s=0.05)
    handler.go.release()  # one slot frees and the other seven stay busy: it fetches after the wait anyway
    await until(lambda: len(broker.fetches) == 2)
    assert broker.fetches[1] == (1, 1)
    for _ in range(8):
        handler.go.release()
    await until(lambda: len(handler.applied) == 9)
    await runtime.shutdown(grace_s=1)
    await broker.close()


class SharedAcks(CountingFetches):
    """A broker whose acks queued together share a transaction (it has ``ack_nowait``, as the embedded
    one has): the runtime holds them back."""

    def __init__(self) -> None:
        super().__init__()
        self.acked: list[str] = []

    def ack_nowait(self, delivery: Delivery) -> asyncio.Future[None]:
        self.acked.append(delivery.key)
        return asyncio.ensure_future(self.ack(delivery))


async def test_acks_trickling_in_wait_for_the_others_under_way_on_a_broker_whose_acks_share_transactions() -> None:
    broker = SharedAcks()
    handler = OneByOne()
    runtime = ConsumerRuntime(broker, [(handler, options(concurrency=4, batch_size=4, ack_linger_s=30))])
    await publish(broker, *(f"e{i}" for i in range(4)))
    runtime.start()
    await until(lambda: len(broker.fetches) >= 1)
    for n in range(1, 4):
        handler.go.release()
        await until(lambda n=n: len(handler.applied) == n)  # type: ignore[misc]
    assert broker.acked == []  # the fourth delivery is still under way: their acks wait for its
    handler.go.release()
    await until(lambda: len(broker.acked) == 4)  # together, once every delivery under way was done
    await until(lambda: _lag(broker, 0))
    await runtime.shutdown(grace_s=1)
    await broker.close()


async def test_an_ack_is_not_held_back_for_deliveries_waiting_behind_it_for_their_key() -> None:
    """ordered_by_key: a room's later deliveries wait for its earlier one to settle, so they cannot ack
    before it; holding its ack back for them would cost every delivery of the room the whole linger."""
    broker = SharedAcks()
    runtime = ConsumerRuntime(
        broker, [(Recorder(), options(concurrency=4, batch_size=4, ack_linger_s=30, ordered_by_key=True))]
    )
    for key in ("e0", "e1", "e2"):
        message = OutgoingMessage(topic=TOPIC, body=b"x", key=key, sharding_key="one-room")
        await broker.publish(message, timeout_s=1)
    runtime.start()
    await until(lambda: broker.fetches[:1] == [(4, 3)])  # the three in one fetch: two wait behind the first
    await until(lambda: broker.acked == ["e0", "e1", "e2"])  # each at once, in the room's order
    await until(lambda: _lag(broker, 0))
    await runtime.shutdown(grace_s=1)
    await broker.close()


async def test_waiting_for_a_keys_previous_delivery_ends_with_it_whatever_its_outcome_and_alone() -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()

    async def previous() -> None:
        await gate
        raise RuntimeError("its failure is not the waiter's")

    first = asyncio.create_task(previous())
    cancelled = asyncio.create_task(_finished(first))
    waiting = asyncio.create_task(_finished(first))
    await asyncio.sleep(0)  # one turn: both wait on the first
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert not first.done()  # cancelling a waiter leaves the delivery it waits for alone
    assert not waiting.done()
    gate.set_result(None)
    await waiting  # woken by the failure, without raising it
    assert isinstance(first.exception(), RuntimeError)
