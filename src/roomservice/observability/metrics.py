"""Prometheus metrics of the command path (the outbox worker adds its own)."""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import truediv
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import QueuePool


class FlushingRegistry(CollectorRegistry):
    """A registry that applies observations still held back (:class:`CommandMetrics`) before every
    collect, so a scrape or ``get_sample_value`` always sees every command already recorded."""

    def __init__(self, *, auto_describe: bool = False) -> None:
        super().__init__(auto_describe=auto_describe)
        self.before_collect: list[Callable[[], None]] = []

    def collect(self) -> Iterable[Metric]:
        for flush in self.before_collect:
            flush()
        return super().collect()


REGISTRY = FlushingRegistry(auto_describe=True)


# --------------------------------------------------------------------------- outbox worker

OUTBOX_DELIVERIES = Counter(
    "room_outbox_deliveries_total",
    "Publish attempts by target and outcome (ok, retryable, permanent, timeout)",
    ["target", "outcome"],
    registry=REGISTRY,
)
OUTBOX_ROWS_FINISHED = Counter(
    "room_outbox_rows_finished_total",
    "Claimed rows finished, by the status they went to",
    ["status"],
    registry=REGISTRY,
)
OUTBOX_PUBLISH_SECONDS = Histogram(
    "room_outbox_publish_seconds",
    "Latency of one publish attempt",
    ["target"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
    registry=REGISTRY,
)
OUTBOX_CLAIM_BATCH = Histogram(
    "room_outbox_claim_batch_size",
    "Rows taken by one claim",
    buckets=(0, 1, 2, 5, 10, 25, 50, 100, 250, 500),
    registry=REGISTRY,
)
OUTBOX_COMMIT_TO_DELIVERED_SECONDS = Histogram(
    "room_outbox_commit_to_delivered_seconds",
    "From the command's commit to the row becoming delivered",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
    registry=REGISTRY,
)


_FEW_VALUES = 4  # observe_many: up to this many values increment their buckets one by one


def observe_many(histogram: Any, values: Sequence[float]) -> None:
    """``histogram.observe(v)`` for each of ``values``, in one pass: each bucket and the sum are
    incremented once (one lock each) instead of once per value. The outbox worker observes a
    batch's publish latencies this way, at the batch's end. It reads prometheus_client's own
    bucket bounds and values; a histogram without them (another client version) is observed
    value by value."""
    if not values:
        return
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(value)
        return
    last = len(bounds) - 1
    total.inc(sum(values))
    if len(values) <= _FEW_VALUES:  # a bucket each, no pass over every bucket (one command a turn, say)
        for value in values:  # the first bucket whose bound is >= the value, as observe() picks it
            buckets[min(bisect_left(bounds, value), last)].inc(1)
        return
    # each value's bucket found and counted in C (map, set, list.count), not in a Python loop a value:
    # a batch's values fall in a few buckets
    indexes = list(map(bisect_left, repeat(bounds), values))
    for index in set(indexes):
        buckets[min(index, last)].inc(indexes.count(index))


OUTBOX_BACKLOG = Gauge("room_outbox_rows", "Outbox rows by status (sampled)", ["status"], registry=REGISTRY)
OUTBOX_OLDEST_PENDING_SECONDS = Gauge(
    "room_outbox_oldest_pending_age_seconds", "Age of the oldest pending row (sampled)", registry=REGISTRY
)


# --------------------------------------------------------------------------- consumer groups

CONSUMER_MESSAGES = Counter(
    "room_consumer_messages_total",
    "Deliveries handled by a consumer group, by outcome (applied, duplicate, failed, redeliver)",
    ["group", "outcome"],
    registry=REGISTRY,
)
CONSUMER_REDELIVERIES = Counter(
    "room_consumer_redeliveries_total",
    "Deliveries that were not a message's first (delivery_count > 1)",
    ["group"],
    registry=REGISTRY,
)
CONSUMER_HANDLE_SECONDS = Histogram(
    "room_consumer_handle_seconds",
    "Time one delivery took to handle",
    ["group"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
    registry=REGISTRY,
)
CONSUMER_LAG = Gauge(
    "room_consumer_lag", "Messages a group has not acknowledged (sampled)", ["group"], registry=REGISTRY
)
CONSUMER_DEAD_LETTERS = Gauge(
    "room_consumer_dead_letters", "Messages in a group's dead letter (sampled)", ["group"], registry=REGISTRY
)
BROKER_UP = Gauge(
    "room_broker_up",
    "1 when the broker answered the last ping (/readyz), 0 when it did not, NaN before any ping",
    registry=REGISTRY,
)
BROKER_UP.set(float("nan"))  # a process that has no broker (or was never probed) never reads as "down"


def consumer_group_started(group: str) -> None:
    """Export a group's counters at 0 before its first delivery (rate() then sees the first increment)."""
    for outcome in ("applied", "duplicate", "failed", "redeliver"):
        CONSUMER_MESSAGES.labels(group, outcome)
    CONSUMER_REDELIVERIES.labels(group)


# --------------------------------------------------------------------------- command stages

STAGES: Final = ("idempotency", "lease", "wallet_debit", "save_mutation", "snapshot", "projection", "total")
"""The stages of ``room_command_timing`` that get a latency histogram (``room_command_stage_seconds``)."""

_LAST_STAGE: Final = len(STAGES) - 1
_FLUSH_AT: Final = 1024  # recorded commands held back at most (a loop that never ran its flush)


class _HeldBack:
    """Entries held back and applied together (:meth:`_apply`) once per turn of the event loop
    (``call_soon`` by a batch's first entry), when :data:`_FLUSH_AT` are held, and before every
    collect of the registry. :meth:`flush` is safe from any thread: the loop's thread only appends,
    and a flush takes exactly the entries it copied (a list copy and a slice delete are atomic)."""

    def __init__(self, registry: FlushingRegistry) -> None:
        self._held: list[Any] = []
        registry.before_collect.append(self.flush)

    def _hold(self, entry: Any) -> None:
        held = self._held
        held.append(entry)
        if len(held) == 1:  # the batch's first: apply the batch once this turn of the loop is over
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop (a synchronous caller): nothing to batch with
                self.flush()
        elif len(held) >= _FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        """Apply every entry held."""
        held = self._held
        batch = held[:]
        if batch:
            del held[: len(batch)]
            self._apply(batch)

    def _apply(self, batch: list[Any]) -> None:
        raise NotImplementedError


class CommandMetrics(_HeldBack):
    """``room_commands_total``, ``room_command_seconds`` and ``room_command_stage_seconds``.

    A command is recorded (:meth:`record`: one list append) and applied with the other commands
    recorded in the same turn of the event loop (:meth:`flush`, scheduled with ``call_soon`` by a
    batch's first record): each counter child incremented once by the batch's count, each
    histogram child updated by :func:`observe_many` (one increment per bucket) instead of one
    ``observe`` per value — prometheus-client takes a lock for the sum and one for the bucket of
    every value, ~10 µs of a command's 7 to 8 observations (issue 12). The registry flushes before
    every collect, so what is exported never misses a recorded command; :meth:`observe` is the
    same thing value by value (the reference the batched path is tested against).
    """

    def __init__(self, registry: FlushingRegistry) -> None:
        self.commands = Counter(
            "room_commands_total", "Room write commands by command and result", ["command", "result"], registry=registry
        )
        self.seconds = Histogram(
            "room_command_seconds",
            "Room write command latency",
            ["command"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )
        self.stage_seconds = Histogram(
            "room_command_stage_seconds",
            "Time one command spent in a stage of room_command_timing (a stage that did not run is not observed)",
            ["command", "stage"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )
        # label children cached: labels() takes a lock each call
        self._counters: dict[tuple[str, str], Counter] = {}
        self._histograms: dict[str, tuple[Histogram, ...]] = {}  # room_command_seconds, then one per stage
        super().__init__(registry)

    def record(self, command: str, result: str, stage_ms: Sequence[float]) -> None:
        """One command: counted by ``(command, result)``; its stage timings, in :data:`STAGES` order
        and milliseconds, observed (a stage at exactly 0 never ran and is skipped, except ``total``,
        always observed, in ``room_command_seconds`` too). Applied by the next :meth:`flush`."""
        self._hold((command, result, stage_ms))

    def _apply(self, batch: list[tuple[str, str, Sequence[float]]]) -> None:
        counts: dict[tuple[str, str], int] = {}
        rows_of: dict[str, list[Sequence[float]]] = {}
        for command, result, stage_ms in batch:
            key = (command, result)
            counts[key] = counts.get(key, 0) + 1
            rows = rows_of.get(command)
            if rows is None:
                rows_of[command] = [stage_ms]
            else:
                rows.append(stage_ms)
        for key, count in counts.items():
            self._counter(*key).inc(count)
        for command, rows in rows_of.items():
            seconds, *stages = self._children(command)
            # the batch's stage timings a stage at a time (zip transposes in C): a stage's values in
            # seconds, those that ran (> 0); total always, in room_command_seconds too
            for i, (child, column) in enumerate(zip(stages, zip(*rows, strict=True), strict=True)):
                if i == _LAST_STAGE:
                    observed = list(map(truediv, column, repeat(1000.0)))
                    observe_many(seconds, observed)
                else:
                    observed = [ms / 1000.0 for ms in column if ms > 0]
                observe_many(child, observed)

    def observe(self, command: str, result: str, stage_ms: Sequence[float]) -> None:
        """What :meth:`record` does for one command, at once and value by value."""
        self._counter(command, result).inc()
        seconds, *stages = self._children(command)
        seconds.observe(stage_ms[_LAST_STAGE] / 1000.0)
        for i, (child, ms) in enumerate(zip(stages, stage_ms, strict=True)):
            if ms > 0 or i == _LAST_STAGE:
                child.observe(ms / 1000.0)

    def _counter(self, command: str, result: str) -> Counter:
        key = (command, result)
        child = self._counters.get(key)
        if child is None:
            child = self._counters[key] = self.commands.labels(command, result)
        return child

    def _children(self, command: str) -> tuple[Histogram, ...]:
        children = self._histograms.get(command)
        if children is None:
            children = self._histograms[command] = (
                self.seconds.labels(command),
                *(self.stage_seconds.labels(command, stage) for stage in STAGES),
            )
        return children


class HeldBack(_HeldBack):
    """Counter increments and histogram observations of a hot path (a consumer delivery, an outbox
    publish attempt), held back and applied once per turn of the event loop, as
    :class:`CommandMetrics` does for commands: each child incremented once by its count, each
    histogram child with :func:`observe_many`. Entries: (child, value), None a counter's +1; or
    (counter, histogram, value): both at once, one entry."""

    def inc(self, counter: Any) -> None:
        """``counter.inc()``, applied by the next flush."""
        self._hold((counter, None))

    def observe(self, histogram: Any, value: float) -> None:
        """``histogram.observe(value)``, applied by the next flush."""
        self._hold((histogram, value))

    def inc_and_observe(self, counter: Any, histogram: Any, value: float) -> None:
        """``counter.inc()`` and ``histogram.observe(value)`` (an attempt counted and timed), held as
        one entry: one append instead of two a row on the outbox worker's row-after-row path."""
        self._hold((counter, histogram, value))

    def _apply(self, batch: list[tuple[Any, ...]]) -> None:
        counts: dict[Any, int] = {}
        values: dict[Any, list[float]] = {}
        for entry in batch:
            if len(entry) == 3:
                counter, child, value = entry
                counts[counter] = counts.get(counter, 0) + 1
                values.setdefault(child, []).append(value)
                continue
            child, value = entry
            if value is None:
                counts[child] = counts.get(child, 0) + 1
            else:
                values.setdefault(child, []).append(value)
        for counter, count in counts.items():
            counter.inc(count)
        for histogram, observed in values.items():
            observe_many(histogram, observed)


COMMAND_METRICS = CommandMetrics(REGISTRY)
COMMANDS, COMMAND_SECONDS, COMMAND_STAGE_SECONDS = (
    COMMAND_METRICS.commands,
    COMMAND_METRICS.seconds,
    COMMAND_METRICS.stage_seconds,
)
HELD_BACK = HeldBack(REGISTRY)


# --------------------------------------------------------------------------- leases

LEASE_ACQUISITIONS = Counter(
    "room_lease_acquisitions_total",
    "Room lease acquisitions by a cell load, by result (acquired, refused: another process holds it, "
    "unavailable: the lease store did not answer)",
    ["result"],
    registry=REGISTRY,
)
LEASE_LOSSES = Counter(
    "room_lease_losses_total",
    "Cells retired because their lease was lost, by how it was found (ensure: the lease could not be "
    "confirmed before a command, fenced: the store refused the cell's epoch, on_lost: the renewal loop)",
    ["reason"],
    registry=REGISTRY,
)
LEASE_RESULTS: Final = ("acquired", "refused", "unavailable")
LEASE_LOSS_REASONS: Final = ("ensure", "fenced", "on_lost")
# every known label value exported from the start, so rate() and the alerts see the first increment
LEASE_ACQUIRED, LEASE_REFUSED, LEASE_UNAVAILABLE = (LEASE_ACQUISITIONS.labels(r) for r in LEASE_RESULTS)
for _reason in LEASE_LOSS_REASONS:
    LEASE_LOSSES.labels(_reason)


def lease_lost(reason: str) -> None:
    LEASE_LOSSES.labels(reason).inc()


# --------------------------------------------------------------------------- database pool

DB_POOL_CHECKED_OUT = Gauge("room_db_pool_checked_out", "Database connections in use (sampled)", registry=REGISTRY)
DB_POOL_SIZE = Gauge("room_db_pool_size", "Configured size of the database pool (sampled)", registry=REGISTRY)
DB_POOL_OVERFLOW = Gauge(
    "room_db_pool_overflow",
    "Connections beyond the pool size (negative: pool slots not yet opened; sampled)",
    registry=REGISTRY,
)


def sample_db_pool(engine: AsyncEngine) -> None:
    """Set the pool gauges from ``engine``'s pool (a queue pool; other pools, such as a private
    in-memory SQLite's, have no size and leave the gauges alone)."""
    pool = engine.pool
    if isinstance(pool, QueuePool):
        DB_POOL_CHECKED_OUT.set(pool.checkedout())
        DB_POOL_SIZE.set(pool.size())
        DB_POOL_OVERFLOW.set(pool.overflow())
