"""Composition by role: a small core plus one builder per role; ``Process`` composes the roles a process runs.

core         settings, database, clock, health checks, background tasks
commands     the command pipeline: store, leases, Room Cells, wallet, projections, RoomService
direct       the direct-mode targets (Tencent IM, activity) and the in-process services they talk to
outbox       the outbox worker and its publishers (needs no cells)
timers       the durable treasure timer's runner (needs the command pipeline to open boxes)
maintenance  retention sweeps, command-log pruning, wallet reconciliation, backlog metrics
broker       opening the configured broker; which consumer groups the configuration enables
consumers    the consumer runtime with those groups
process      ``Process.running(settings, roles=...)``: what ``serve`` and ``worker`` start

Importing this package does not import ``process`` (and with it FastAPI, gRPC,
OpenTelemetry and every adapter): the admin CLI needs only ``broker`` and
``core``, and a ``room-service outbox``/``broker`` command started that whole
graph (about a second) before it read its arguments. The names below are
loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from roomservice.bootstrap.process import (
        API,
        CONSUME_ROLES,
        CONSUMERS,
        MAINTENANCE,
        OUTBOX,
        SERVE_ROLES,
        TIMERS,
        WORKER_ROLES,
        Process,
    )

__all__ = [
    "API",
    "CONSUMERS",
    "CONSUME_ROLES",
    "MAINTENANCE",
    "OUTBOX",
    "SERVE_ROLES",
    "TIMERS",
    "WORKER_ROLES",
    "Process",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from roomservice.bootstrap import process

        return getattr(process, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
