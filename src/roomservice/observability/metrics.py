"""Prometheus metrics of the command path (the outbox worker adds its own)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import QueuePool

REGISTRY = CollectorRegistry(auto_describe=True)

COMMANDS = Counter(
    "room_commands_total", "Room write commands by command and result", ["command", "result"], registry=REGISTRY
)
COMMAND_SECONDS = Histogram(
    "room_command_seconds",
    "Room write command latency",
    ["command"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
    registry=REGISTRY,
)


_children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}


def observe_command(command: str, result: str, seconds: float) -> None:
    """Count and time one command (label children cached: labels() takes a lock each call)."""
    key = (command, result)
    child = _children.get(key)
    if child is None:
        child = _children[key] = (COMMANDS.labels(command, result), COMMAND_SECONDS.labels(command))
    child[0].inc()
    child[1].observe(seconds)


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
    counts = [0] * len(bounds)
    last = len(bounds) - 1
    for value in values:  # the first bucket whose bound is >= the value, as observe() picks it
        counts[min(bisect_left(bounds, value), last)] += 1
    total.inc(sum(values))
    for bucket, count in zip(buckets, counts, strict=True):
        if count:
            bucket.inc(count)


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

COMMAND_STAGE_SECONDS = Histogram(
    "room_command_stage_seconds",
    "Time one command spent in a stage of room_command_timing (a stage that did not run is not observed)",
    ["command", "stage"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
    registry=REGISTRY,
)

_stage_children: dict[str, tuple[Histogram, ...]] = {}


def observe_stages(command: str, stage_ms: Sequence[float]) -> None:
    """Observe one command's stage timings, in :data:`STAGES` order, in milliseconds.

    A stage at exactly 0 never ran (no gift, no snapshot due, a replay) and is
    skipped, except ``total``, which is always observed.
    """
    children = _stage_children.get(command)
    if children is None:
        children = _stage_children[command] = tuple(COMMAND_STAGE_SECONDS.labels(command, s) for s in STAGES)
    last = len(STAGES) - 1
    for i, (child, value) in enumerate(zip(children, stage_ms, strict=True)):
        if value > 0 or i == last:
            child.observe(value / 1000.0)


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
