"""Prometheus metrics of the command path (the outbox worker adds its own)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
BROKER_UP = Gauge("room_broker_up", "1 when the broker answered the last ping, else 0", registry=REGISTRY)
