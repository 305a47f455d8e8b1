"""Prometheus metrics of the command path (the outbox worker adds its own)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

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
