"""The consumer runtime: fetch a group's deliveries, hand each to the group's handler, ack or nack.

Per delivery the handler decodes the message, skips what the group already
processed (for effects in our database the processed record is written in
the same transaction as the effect; for external effects an idempotency key
from the event_id goes with the call and a sent record is written after
success) and applies the rest. The runtime acks what the handler finished,
nacks what failed with exponential backoff, and leaves the dead-lettering to
the broker (``max_deliveries``), so the group moves on. Groups run as
independent loops: one poison message holds up nothing but itself, and a
broker or database outage makes a loop wait and retry, never die.

One log line per failed delivery (``consumer_delivery_failed``), never more.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from roomservice import errors
from roomservice.brokers.port import Broker, Delivery
from roomservice.coalesce import HeldBack
from roomservice.observability import metrics as m
from roomservice.observability import tracing
from roomservice.observability.logging import context_variable, get_logger
from roomservice.outbox.policy import RetryPolicy

_log = get_logger("roomservice.consumers")

# A handler running longer than this many visibility timeouts is taken for hung and cancelled; its delivery
# comes back (every effect is bounded by its own timeouts well below that: IM calls by the publish timeout,
# database calls by database.timeout).
HUNG_AFTER_TIMEOUTS = 10
_GROUP, _EVENT_ID = context_variable("consumer_group"), context_variable("event_id")  # named on every line


class Outcome(StrEnum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # the group had processed this event already: acked, nothing applied


class Redeliver(errors.RoomServiceError):
    """Not a failure: deliver this message again after ``delay_s`` (e.g. a treasure wake-up that came early)."""

    code = "redeliver"
    retryable = True

    def __init__(self, delay_s: float, message: str | None = None) -> None:
        super().__init__(message or f"redeliver in {delay_s:.3f}s")
        self.delay_s = delay_s


class Handler(Protocol):
    """One consumer group's work. ``handle`` raises to fail the delivery (nacked with backoff)."""

    group: str
    topic: str

    async def handle(self, delivery: Delivery) -> Outcome: ...


@dataclass(frozen=True, slots=True)
class GroupOptions:
    max_deliveries: int  # 1 + consumer_max_reconsume_times
    batch_size: int = 32  # most deliveries one fetch asks for (never more than the free slots)
    concurrency: int = 32  # deliveries of one group handled at once (as many as a fetch takes)
    visibility_s: float = 30.0  # a delivery not acked by then comes back
    wait_s: float = 1.0  # long-poll of one fetch
    # While deliveries are in flight, a fetch waits up to this long for half the slots to be free: a
    # fetch into each slot as it frees costs a claim per delivery (the IM bridge's deliveries free
    # one by one, at its rate limit) while those in flight keep the group busy meanwhile. 0: never.
    refill_wait_s: float = 0.1
    # On a broker whose acks queued together share a transaction (it has ``ack_nowait``: the embedded
    # one), an ack waits up to this long for the acks of the group's other deliveries under way (none
    # under way: it goes at once), so that acks trickling in a few milliseconds apart share one. 0: never.
    ack_linger_s: float = 0.02
    # handle one sharding key's (one room's) deliveries one after the other, in the order they were fetched,
    # while other keys run concurrently (the IM bridge: a client sees a room's messages in a sensible order)
    ordered_by_key: bool = False
    backoff: RetryPolicy = field(
        default_factory=lambda: RetryPolicy(initial_backoff_ms=1000, max_backoff_ms=60_000, max_retry_count=1 << 30)
    )


@dataclass(slots=True)
class GroupCounts:
    applied: int = 0
    duplicates: int = 0
    failures: int = 0
    redelivered: int = 0


class GroupRunner:
    """One group's loop: fetch, handle concurrently, ack/nack; survives broker and handler failures."""

    def __init__(self, broker: Broker, handler: Handler, options: GroupOptions) -> None:
        self.broker = broker
        self.handler = handler
        self.options = options
        self.counts = GroupCounts()
        m.consumer_group_started(handler.group)
        # the group's metric children, looked up once: labels() costs a lock and a dict walk per call
        self._counted = {o: m.CONSUMER_MESSAGES.labels(handler.group, o) for o in ("failed", "redeliver", *Outcome)}
        self._redeliveries = m.CONSUMER_REDELIVERIES.labels(handler.group)
        self._handle_seconds = m.CONSUMER_HANDLE_SECONDS.labels(handler.group)
        self._stopping = asyncio.Event()
        self._slots = asyncio.Semaphore(options.concurrency)
        self._handling = 0  # slots held by deliveries (fetched, not settled yet)
        # deliveries being handled: fetched and not waiting for their key's previous one to settle
        # (ordered_by_key); only those can ack soon, so only those are worth holding an ack back for
        self._running = 0
        self._freed = asyncio.Event()  # a delivery let its slot go
        self._refill_at = max(1, min(options.batch_size, options.concurrency) // 2)
        ack_nowait = getattr(broker, "ack_nowait", None)  # queued at once, without a task per ack
        self._ack = HeldBack(
            ack_nowait or broker.ack,
            linger_s=options.ack_linger_s if ack_nowait is not None else 0.0,
            expected=lambda: self._running,
        )
        self._in_flight: set[asyncio.Task[None]] = set()
        self._last_of_key: dict[str, asyncio.Task[None]] = {}
        # every delivery fetched and not settled yet, with when its visibility last started (its fetch or
        # its last touch): the keep-alive touches those at a third of their visibility timeout
        self._held: dict[int, _Held] = {}
        self._task: asyncio.Task[None] | None = None
        self._keep_alive: asyncio.Task[None] | None = None
        self._fetch_failures = 0

    @property
    def group(self) -> str:
        return self.handler.group

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self._run(), name=f"consumer:{self.group}")
        self._keep_alive = asyncio.create_task(self._touch_held(), name=f"consumer-keep-alive:{self.group}")
        return self._task

    async def _run(self) -> None:
        opts = self.options
        await self._declare()
        _log.info("consumer_group_started", group=self.group, topic=self.handler.topic)
        while not self._stopping.is_set():
            # Fetch only what can start at once: wait for one free slot, then take every other free one
            # (a delivery fetched with no slot to run in would spend its visibility timeout waiting).
            await self._slots.acquire()
            reserved = 1 + await self._free_slots(opts.batch_size - 1)
            if reserved < self._refill_at and self._handling and opts.refill_wait_s > 0:
                reserved += await self._slots_freed(self._refill_at - reserved, opts.refill_wait_s)
            fetching_at = time.monotonic()  # the visibility of what comes back started no earlier
            try:
                deliveries = await self.broker.fetch(
                    self.handler.topic,
                    self.group,
                    max_messages=reserved,
                    wait_s=opts.wait_s,
                    visibility_s=opts.visibility_s,
                )
                self._fetch_failures = 0
            except Exception as exc:
                self._release(reserved)
                await self._pause_after_fetch_failure(exc)
                continue
            self._release(reserved - len(deliveries))
            self._handling += len(deliveries)
            for delivery in deliveries:  # each holds one reserved slot until it is settled
                before = self._last_of_key.get(delivery.sharding_key) if opts.ordered_by_key else None
                task = asyncio.create_task(
                    self._handle(delivery, after=before), name=f"consume:{self.group}:{delivery.key}"
                )
                self._held[id(delivery)] = _Held(delivery, task, fetching_at)
                self._in_flight.add(task)
                task.add_done_callback(self._in_flight.discard)
                if opts.ordered_by_key:
                    self._last_of_key[delivery.sharding_key] = task
                    task.add_done_callback(functools.partial(self._forget_key, delivery.sharding_key))

    def _release(self, slots: int) -> None:
        for _ in range(slots):
            self._slots.release()

    async def _free_slots(self, most: int) -> int:
        """Reserve the slots free now, up to ``most``; how many."""
        taken = 0
        while taken < most and not self._slots.locked():
            await self._slots.acquire()  # free: returns at once
            taken += 1
        return taken

    async def _slots_freed(self, wanted: int, wait_s: float) -> int:
        """Reserve up to ``wanted`` more slots as deliveries in flight let theirs go, for at most
        ``wait_s`` and only while some are in flight (once none is, nothing more comes free)."""
        taken = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                while True:
                    self._freed.clear()
                    taken += await self._free_slots(wanted - taken)
                    if taken >= wanted or not self._handling or self._stopping.is_set():
                        break
                    await self._freed.wait()
        return taken

    async def _declare(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.broker.declare_group(
                    self.handler.topic, self.group, max_deliveries=self.options.max_deliveries
                )
                return
            except Exception as exc:
                await self._pause_after_fetch_failure(exc)

    async def _pause_after_fetch_failure(self, exc: BaseException) -> None:
        self._fetch_failures += 1
        delay_s = min(5.0, 0.1 * 2 ** min(self._fetch_failures, 6))
        if self._fetch_failures == 1 or self._fetch_failures % 20 == 0:  # no log flood during an outage
            _log.warning("consumer_fetch_failed", group=self.group, failures=self._fetch_failures, error=repr(exc))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=delay_s)

    def _forget_key(self, key: str, task: asyncio.Task[None]) -> None:
        if self._last_of_key.get(key) is task:
            del self._last_of_key[key]

    async def _handle(self, delivery: Delivery, *, after: asyncio.Task[None] | None = None) -> None:
        try:
            if after is not None and not after.done():  # the same key's previous delivery goes first
                await _finished(after)
            held = self._held.get(id(delivery))
            if held is not None:
                held.handling_since = time.monotonic()
            # every line a handler logs names the group and the event (the key is the event_id)
            named = _GROUP.set(self.group), _EVENT_ID.set(delivery.key)
            try:
                await self._handle_bound(delivery)
            finally:
                _EVENT_ID.reset(named[1])
                _GROUP.reset(named[0])
        finally:
            self._held.pop(id(delivery), None)  # settled, or cancelled (a stop): the broker's again

    async def _touch_held(self) -> None:
        """Keep every delivery held here from coming back while it is: each one whose visibility started a
        third of a timeout ago is touched. A delivery waits behind its key's previous one (ordered_by_key:
        a room's burst behind a slow target) or its handler runs long (a notice's two IM calls, each up to
        the publish timeout); one that came back meanwhile would be handled twice and count deliveries
        towards a dead letter it never earned. Checked every sixth of a timeout: none goes unseen longer
        than half of one. A touch runs in a task of its own (a slow one holds up no other), and never
        while the delivery is being settled: an ack or nack waits for a touch under way (on RocketMQ a
        touch gives the delivery a new receipt, which the ack must carry). A handler still running after
        :data:`HUNG_AFTER_TIMEOUTS` timeouts is taken for hung and cancelled, as a stop cancels it: its
        slot and its key's turn go to the others, and the delivery comes back."""
        visibility_s = self.options.visibility_s
        while True:
            await asyncio.sleep(visibility_s / 6)
            now = time.monotonic()
            due, hung = now - visibility_s / 3, now - HUNG_AFTER_TIMEOUTS * visibility_s
            for held in list(self._held.values()):
                if held.settling or held.touching is not None:
                    continue
                if held.handling_since is not None and held.handling_since <= hung:
                    _log.warning(
                        "consumer_delivery_hung",
                        group=self.group,
                        key=held.delivery.key,
                        handling_s=round(now - held.handling_since, 3),
                    )
                    held.settling = True  # not touched again
                    held.task.cancel()
                elif held.since <= due:
                    held.touching = asyncio.ensure_future(self._touch(held))

    async def _touch(self, held: _Held) -> None:
        started = time.monotonic()
        try:
            await self.broker.touch(held.delivery, visibility_s=self.options.visibility_s)
            held.since = started
        except Exception as exc:  # tried again next time; if it runs out, it comes back: a duplicate, deduplicated
            _log.warning("consumer_touch_failed", group=self.group, key=held.delivery.key, error=repr(exc))
        finally:
            held.touching = None

    async def _handle_bound(self, delivery: Delivery) -> None:
        group = self.group
        started = time.perf_counter()
        if delivery.delivery_count > 1:
            self.counts.redelivered += 1
            self._redeliveries.inc()
        self._running += 1
        try:
            try:
                if tracing.ENABLED:  # continues the trace context of the message's headers
                    outcome = await tracing.traced_consume(
                        group,
                        delivery.key,
                        delivery.tag,
                        delivery.delivery_count,
                        delivery.headers,
                        lambda: self.handler.handle(delivery),
                    )
                else:
                    outcome = await self.handler.handle(delivery)
            except Redeliver as again:
                self._counted["redeliver"].inc()
                await self._settle(delivery, nack_delay_s=again.delay_s, reason=again.message)
                return
            except Exception as exc:
                self.counts.failures += 1
                self._counted["failed"].inc()
                delay_s = self.options.backoff.backoff_ms(delivery.delivery_count) / 1000
                last = delivery.delivery_count >= self.options.max_deliveries
                _log.warning(
                    "consumer_delivery_failed",
                    group=group,
                    key=delivery.key,
                    tag=delivery.tag,
                    delivery_count=delivery.delivery_count,
                    dead_letter=last,
                    retry_in_s=None if last else round(delay_s, 3),
                    error=repr(exc),
                )
                await self._settle(delivery, nack_delay_s=delay_s, reason=f"{type(exc).__name__}: {exc}")
                return
            if outcome is Outcome.DUPLICATE:
                self.counts.duplicates += 1
            else:
                self.counts.applied += 1
            m.HELD_BACK.inc(self._counted[outcome])  # once per turn of the loop with the others
            await self._settle(delivery, nack_delay_s=None, reason="")
        finally:
            m.HELD_BACK.observe(self._handle_seconds, time.perf_counter() - started)
            self._running -= 1
            self._handling -= 1
            self._slots.release()
            self._freed.set()

    async def _settle(self, delivery: Delivery, *, nack_delay_s: float | None, reason: str) -> None:
        """Ack or nack; if the broker does not answer, the delivery comes back after its visibility timeout."""
        held = self._held.get(id(delivery))
        if held is not None:
            held.settling = True
            if held.touching is not None:  # its receipt may change: settle with the one the touch leaves
                await asyncio.wait([held.touching])
        try:
            if nack_delay_s is None:
                await self._ack(delivery)
            else:
                await self.broker.nack(delivery, delay_s=nack_delay_s, reason=reason[:500])
        except Exception as exc:
            _log.warning(
                "consumer_settle_failed", group=self.group, key=delivery.key, ack=nack_delay_s is None, error=repr(exc)
            )

    async def shutdown(self, *, grace_s: float) -> None:
        """Stop fetching, let deliveries in flight finish for up to ``grace_s``, then cancel them
        (a cancelled delivery is not acked: the broker redelivers it after its visibility timeout)."""
        self._stopping.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout=grace_s)
            except TimeoutError:
                self._task.cancel()
            except Exception:
                pass
        pending = list(self._in_flight)
        if pending:
            _, still = await asyncio.wait(pending, timeout=grace_s)
            for task in still:
                task.cancel()
            await asyncio.gather(*still, return_exceptions=True)
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._keep_alive is not None:
            self._keep_alive.cancel()
            await asyncio.gather(self._keep_alive, return_exceptions=True)
        _log.info("consumer_group_stopped", group=self.group, **_counts(self.counts))


class ConsumerRuntime:
    """The groups this process consumes, each on its own loop."""

    def __init__(self, broker: Broker, groups: Sequence[tuple[Handler, GroupOptions]]) -> None:
        self.broker = broker
        self.runners = [GroupRunner(broker, handler, options) for handler, options in groups]

    @property
    def alive(self) -> bool:
        return all(r.alive for r in self.runners)

    def start(self) -> list[asyncio.Task[None]]:
        return [runner.start() for runner in self.runners]

    def runner(self, group: str) -> GroupRunner:
        return next(r for r in self.runners if r.group == group)

    def counts(self) -> dict[str, dict[str, Any]]:
        """What each group of this process did since it started (``GET /admin/consumers``)."""
        return {r.group: {"running": r.alive, **_counts(r.counts)} for r in self.runners}

    async def sample_stats(self) -> None:
        """Refresh the lag and dead-letter gauges from the broker (best effort)."""
        for runner in self.runners:
            try:
                stats = await self.broker.group_stats(runner.handler.topic, runner.group)
            except Exception as exc:
                _log.warning("consumer_stats_failed", group=runner.group, error=repr(exc))
                continue
            m.CONSUMER_LAG.labels(runner.group).set(stats.lag)
            m.CONSUMER_DEAD_LETTERS.labels(runner.group).set(stats.dead_letters)

    async def shutdown(self, *, grace_s: float) -> None:
        await asyncio.gather(*(runner.shutdown(grace_s=grace_s) for runner in self.runners))


def _counts(counts: GroupCounts) -> dict[str, int]:
    return {
        "applied": counts.applied,
        "duplicates": counts.duplicates,
        "failures": counts.failures,
        "redelivered": counts.redelivered,
    }


class _Held:
    """A delivery fetched and not settled yet, as the keep-alive sees it."""

    __slots__ = ("delivery", "handling_since", "settling", "since", "task", "touching")

    def __init__(self, delivery: Delivery, task: asyncio.Task[None], since: float) -> None:
        self.delivery = delivery
        self.task = task  # its _handle
        self.since = since  # monotonic: when its visibility timeout last started (no later than this)
        self.handling_since: float | None = None  # when its handler started (None: waiting for its turn)
        self.settling = False  # being acked or nacked (or cancelled as hung): not touched any more
        self.touching: asyncio.Future[None] | None = None  # a touch under way


async def _finished(task: asyncio.Task[None]) -> None:
    """Until ``task`` is done, whatever its outcome; cancelling the waiter leaves ``task`` alone.
    ``asyncio.wait([task])`` without its set, its counter and its extra turn of the loop."""
    waiter: asyncio.Future[None] = task.get_loop().create_future()

    def wake(_: asyncio.Task[None]) -> None:
        if not waiter.done():
            waiter.set_result(None)

    task.add_done_callback(wake)
    try:
        await waiter
    finally:
        task.remove_done_callback(wake)
