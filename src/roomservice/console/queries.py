"""What the console's pages read that the admin operations do not: a room's recent commands with their
stored timing, the outbox backlog for the chart, and the IM sandbox's view of what it received."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Connection, bindparam, func, select

from roomservice.integrations.im_sandbox.state import SandboxState
from roomservice.outbox.model import PublishMode, Status, required_targets
from roomservice.store.database import Database
from roomservice.store.tables import room_command_log, room_outbox

_log, _o = room_command_log, room_outbox

BACKLOG_STATUSES: Final = (Status.PENDING.value, Status.RETRYABLE.value, Status.DELIVERING.value)

_RECENT_COMMANDS: Final = (
    select(
        _log.c.id,
        _log.c.command_id,
        _log.c.command_type,
        _log.c.version,
        _log.c.events,
        _log.c.now_ms,
        _log.c.timing,
    )
    .where(_log.c.app_code == bindparam("app_code"), _log.c.room_id == bindparam("room_id"))
    .order_by(_log.c.version.desc(), _log.c.id.desc())
    .limit(bindparam("limit"))
)
_BACKLOG: Final = select(func.count()).select_from(_o).where(_o.c.status.in_(bindparam("statuses", expanding=True)))
TIMING_FIELDS: Final = ("idempotency_ms", "lease_ms", "wallet_debit_ms", "activity_ms")
TIMING_FLAGS: Final = ("activity_async_outbox", "tencent_im_async_outbox")


@dataclass(frozen=True, slots=True)
class CommandRow:
    command_id: str
    command_type: str
    version: int
    event_types: tuple[str, ...]
    now_ms: int
    timing: dict[str, Any] | None  # None: written before timings were stored (migration 0005)


async def recent_commands(db: Database, app_code: str, room_id: str, *, limit: int = 25) -> list[CommandRow]:
    params = {"app_code": app_code, "room_id": room_id, "limit": limit}
    rows = await db.run_read(_all, _RECENT_COMMANDS, params)
    out = []
    for r in rows:
        try:
            types = tuple(str(e.get("type", "?")) for e in json.loads(r.events))
        except (ValueError, AttributeError):
            types = ()
        timing: dict[str, Any] | None = None
        if r.timing:
            try:
                timing = json.loads(r.timing)
            except ValueError:
                timing = None
        out.append(CommandRow(r.command_id, r.command_type, int(r.version), types, int(r.now_ms), timing))
    return out


async def backlog(db: Database) -> int:
    """Rows not finished yet: pending, retryable and delivering (an index range on status)."""
    return int(await db.run_long_read(_scalar, _BACKLOG, {"statuses": list(BACKLOG_STATUSES)}) or 0)


def targets_split(event_type: str, mode: str, done: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(done, pending) targets of a row in this publish mode."""
    required = required_targets(event_type, PublishMode(mode))
    return sorted(set(done)), sorted(required - set(done))


def _all(conn: Connection, statement: Any, params: dict[str, Any]) -> list[Any]:
    return list(conn.execute(statement, params).all())


def _scalar(conn: Connection, statement: Any, params: dict[str, Any]) -> Any:
    return conn.execute(statement, params).scalar()


# --------------------------------------------------------------------------- the IM sandbox


@dataclass(frozen=True, slots=True)
class SandboxGroup:
    group_id: str
    type: str
    name: str
    owner: str | None
    members: int
    messages: int
    destroyed: bool


def sandbox_groups(state: SandboxState) -> list[SandboxGroup]:
    groups = [*state.groups.values(), *state.destroyed]
    return [
        SandboxGroup(g.group_id, g.type, g.name, g.owner, len(g.members), len(g.messages), g.destroyed_at is not None)
        for g in groups
    ]


def decoded(data: str | None) -> dict[str, Any] | None:
    """The custom message's Data as JSON (event_id, type, room_version, payload), if it is JSON."""
    if not data:
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
