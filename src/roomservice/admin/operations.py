"""Dead-letter administration of ``room_outbox`` (SPEC §4): stats, list, show, replay.

:class:`OutboxAdmin` is the one implementation behind ``room-service outbox …``
and ``/admin/outbox…``. Every operation is one unit on
:meth:`Database.run_read` / :meth:`Database.run_write` (one thread hop on
SQLite, one connection on MySQL/MariaDB); fixed statements are built at import,
filtered ones once per filter *shape* (which filters are present), so repeated
calls reuse SQLAlchemy's compiled cache.

Replay (only rows in status ``failed``):

* default: the row keeps its ``event_id`` and goes back to ``pending``
  (``retry_count = 0``, ``replay_count + 1``, ``due_at_ms = now``, lock,
  ``next_retry_at_ms`` and ``last_error`` cleared). ``targets_done`` is kept:
  targets that already succeeded are not sent again. The previous
  ``retry_count`` and ``last_error`` go into the ``replay`` audit record.
* ``as_repair``: the failed row stays as it is; a NEW row is written with a new
  ``event_id`` (a UUIDv7 in hex, as every event id), the same app/room/version/type and the original
  envelope re-encoded with the new id and ``repair_of`` = the original's id
  (its root's, when the original is itself a repair). Audit: ``repair`` on the
  original (naming the new id), ``repair_of`` on the new row (naming the
  original). A repair by filter (:meth:`OutboxAdmin.replay_matching`) leaves an
  original repaired before (``already_repaired``): run again, or resumed after
  a failed batch, it writes no second repair of each; named ids are repaired
  again, as asked.

  Targets: by default a repair goes only to the targets that had NOT succeeded
  for the original; ``targets`` (names from :data:`REPAIR_TARGETS`) names them
  instead. The worker is not told: the repair row is written with every other
  target its type can have (in any publish mode) already in ``targets_done``,
  so the worker — which sends ``required_targets - targets_done`` — sends the
  chosen ones its mode routes and nothing else. A row whose chosen targets are
  none of its type's gets ``no_targets`` and no repair row. A named target that
  had succeeded is sent again, and its effects still apply once: the activity
  service and the IM publisher's sent record key on the original's id
  (:func:`~roomservice.domain.events.dedup_id`).

A replay of many rows runs in batches. When a batch fails after others committed (the
database went away), :class:`ReplayInterrupted` — an ``unavailable`` error — carries the
report of the committed batches: the HTTP answer (503) gives it beside the error, the CLI
and the console print it. The failing batch's own outcome is unknown; running the same
replay again goes on where it stopped (its replayed rows are no longer ``failed``).

Each batch is one write transaction: the rows are read with ``FOR UPDATE`` (a
no-op on SQLite, whose write transaction already holds the database lock), the
update is guarded by ``status = 'failed'`` and the audit rows are inserted in
the same transaction. A batch with unknown ids or rows in another status never
raises: each id gets its own outcome in the :class:`ReplayReport`.

Inputs compared with ``ascii_bin`` columns — event ids, and the type, app and
room filters — are checked against the identifier patterns of
:mod:`roomservice.domain.limits` before any SQL (:func:`check_event_ids`,
:meth:`OutboxFilter.validated`): MariaDB refuses to compare such a column with
a non-ASCII literal (errors 1267/1270), which surfaced as ``StoreUnavailable``
("database unavailable", 503, CLI exit 1) while SQLite simply found nothing. A
value outside its pattern is :class:`errors.InvalidArgument` naming the field
(400, CLI exit 2) on every backend, even for ``show`` of one id, where "no
such row" would also be true: no row can have such a value, and an operator
who pasted a stray character learns that the id is malformed, not missing.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Final, Literal, TypeAlias

from sqlalchemy import (
    ColumnElement,
    Connection,
    Row,
    Select,
    bindparam,
    func,
    insert,
    select,
    update,
)

from roomservice import errors, wire
from roomservice.domain.events import dedup_id, new_event_id
from roomservice.domain.limits import (
    APP_CODE_PATTERN,
    ID_PATTERN,
    MAX_ID_VALUE,
    ROOM_ID_PATTERN,
    valid_app_code,
    valid_id,
    valid_room_id,
)
from roomservice.domain.routing import Target
from roomservice.durations import parse_duration
from roomservice.outbox.model import PublishMode, Status, format_targets, parse_targets, required_targets
from roomservice.store.database import Database
from roomservice.store.tables import room_outbox, room_outbox_audit

__all__ = [
    "ALL_STATUSES",
    "LEGACY_STATUSES",
    "REPAIR_TARGETS",
    "AuditRecord",
    "OutboxAdmin",
    "OutboxFilter",
    "OutboxRowDetail",
    "OutboxRowView",
    "OutboxStats",
    "ReplayOutcome",
    "ReplayReport",
    "check_event_ids",
    "parse_repair_targets",
    "repair_targets",
]

ALL_STATUSES: Final[tuple[str, ...]] = tuple(s.value for s in Status)
LEGACY_STATUSES: Final[frozenset[str]] = frozenset({Status.PUBLISHED.value})
MAX_LIST_LIMIT: Final = 1000
MAX_BATCH_SIZE: Final = 1000
_MAX_FILTER_TEXT: Final = 200
_ACTOR_MAX: Final = 64  # room_outbox_audit.actor is VARCHAR(64)
# The filter criteria compared with ascii_bin columns, and the pattern every stored value matches
# (app codes and room ids passed it on the way in, SPEC §3; event types are the events' names).
_ID_CRITERIA: Final = (
    ("event_type", ID_PATTERN, valid_id),
    ("app_code", APP_CODE_PATTERN, valid_app_code),
    ("room_id", ROOM_ID_PATTERN, valid_room_id),
)

ReplayResult = Literal["replayed", "not_found", "not_failed", "undecodable", "no_targets", "already_repaired"]

# The delivery targets an operator may name for a repair (``notice`` is a broker consumer, not a target).
REPAIR_TARGETS: Final[tuple[str, ...]] = tuple(
    t.value for t in (Target.IM, Target.ACTIVITY, Target.BROKER, Target.TREASURE_WAKEUP)
)


def check_event_ids(event_ids: Iterable[str], *, name: str = "event_id") -> None:
    """:class:`errors.InvalidArgument` naming ``name`` for the first id outside :data:`ID_PATTERN`.

    Every event id matches it (a UUIDv7 in hex; the activity service refuses others), so such an
    id names no row; it is refused before any SQL because MariaDB fails the comparison of the
    ascii_bin ``event_id`` with a non-ASCII literal instead of finding nothing (module docstring).
    """
    for event_id in event_ids:
        if not valid_id(event_id):
            raise errors.InvalidArgument(f"{name}: {event_id[:40]!r} is not an event id (must match {ID_PATTERN})")


def parse_repair_targets(values: Iterable[str] | None) -> frozenset[str] | None:
    """Target names as people type them (repeated or comma-separated); ``None``: the default.

    :class:`errors.InvalidArgument` for an unknown name or for a list naming none.
    """
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    names = [w.strip() for v in values for w in v.split(",") if w.strip()]
    for name in names:
        if name not in REPAIR_TARGETS:
            raise errors.InvalidArgument(f"unknown target {name[:40]!r}; expected one of {', '.join(REPAIR_TARGETS)}")
    if not names:
        raise errors.InvalidArgument(f"targets must name at least one of {', '.join(REPAIR_TARGETS)}")
    return frozenset(names)


@functools.cache
def _routable(event_type: str) -> frozenset[str]:
    """Every target a row of ``event_type`` can need, whatever the publish mode."""
    return frozenset().union(*(required_targets(event_type, mode) for mode in PublishMode))


# --------------------------------------------------------------------------- values


def _age_ms(name: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return parse_duration(text) // timedelta(milliseconds=1)
    except ValueError as exc:
        raise errors.InvalidArgument(f"{name}: {exc}") from None


@dataclass(frozen=True, slots=True)
class OutboxFilter:
    """Which rows: every given criterion must hold (all ``None``/empty: every row).

    Ages are relative to "now" and compare ``created_at_ms``: ``older_than_ms``
    keeps rows created at least that long ago, ``newer_than_ms`` rows created
    at most that long ago. ``error_contains`` is a case-insensitive substring of
    ``last_error`` (SQLite folds ASCII letters only).
    """

    statuses: tuple[str, ...] = ()
    event_type: str | None = None
    app_code: str | None = None
    room_id: str | None = None
    older_than_ms: int | None = None
    newer_than_ms: int | None = None
    error_contains: str | None = None

    @classmethod
    def parse(
        cls,
        *,
        statuses: Iterable[str] = (),
        event_type: str | None = None,
        app_code: str | None = None,
        room_id: str | None = None,
        older_than: str | None = None,
        newer_than: str | None = None,
        error_contains: str | None = None,
        names: Mapping[str, str] | None = None,
    ) -> OutboxFilter:
        """A validated filter from text as people type it: statuses repeated or comma-separated,
        ages as Go durations ("10m"). Errors (:class:`errors.InvalidArgument`) use ``names``
        for the criterion, e.g. ``{"older_than": "--older-than", "room_id": "--room"}`` in the CLI."""
        label = names or {}
        return cls(
            statuses=tuple(w.strip() for s in statuses for w in s.split(",") if w.strip()),
            event_type=event_type,
            app_code=app_code,
            room_id=room_id,
            older_than_ms=_age_ms(label.get("older_than", "older_than"), older_than),
            newer_than_ms=_age_ms(label.get("newer_than", "newer_than"), newer_than),
            error_contains=error_contains,
        ).validated(names=label)

    def validated(self, *, names: Mapping[str, str] | None = None) -> OutboxFilter:
        """This filter, deduplicated; :class:`errors.InvalidArgument` naming the first bad criterion
        (``names``: how the caller calls the id criteria, as for :meth:`parse`).

        The type, app and room must match the domain's patterns, not only their lengths: see the
        module docstring (a non-ASCII value made MariaDB answer "database unavailable")."""
        statuses: list[str] = []
        for status in self.statuses:
            if status not in ALL_STATUSES:
                raise errors.InvalidArgument(f"unknown status {status!r}; expected one of {', '.join(ALL_STATUSES)}")
            if status not in statuses:
                statuses.append(status)
        label = names or {}
        for name, pattern, valid in _ID_CRITERIA:
            value = getattr(self, name)
            if value is not None and not valid(value):
                raise errors.InvalidArgument(f"{label.get(name, name)}: {value[:40]!r} does not match {pattern}")
        if self.error_contains is not None and not 1 <= len(self.error_contains) <= _MAX_FILTER_TEXT:
            raise errors.InvalidArgument(f"error text must be 1..{_MAX_FILTER_TEXT} characters")
        for name in ("older_than_ms", "newer_than_ms"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise errors.InvalidArgument(f"{name} must not be negative")
        if (
            self.older_than_ms is not None
            and self.newer_than_ms is not None
            and self.older_than_ms > self.newer_than_ms
        ):
            raise errors.InvalidArgument("older_than is larger than newer_than: no row can match")
        return replace(self, statuses=tuple(statuses))

    def _shape(self) -> _Shape:
        return (
            bool(self.statuses),
            self.event_type is not None,
            self.app_code is not None,
            self.room_id is not None,
            self.older_than_ms is not None,
            self.newer_than_ms is not None,
            self.error_contains is not None,
        )

    def _params(self, now_ms: int) -> dict[str, Any]:
        params: dict[str, Any] = {}
        if self.statuses:
            params["f_statuses"] = list(self.statuses)
        if self.event_type is not None:
            params["f_event_type"] = self.event_type
        if self.app_code is not None:
            params["f_app_code"] = self.app_code
        if self.room_id is not None:
            params["f_room_id"] = self.room_id
        if self.older_than_ms is not None:
            params["f_created_max"] = now_ms - self.older_than_ms
        if self.newer_than_ms is not None:
            params["f_created_min"] = now_ms - self.newer_than_ms
        if self.error_contains is not None:
            params["f_error_like"] = "%" + _escape_like(self.error_contains.lower()) + "%"
        return params

    def to_dict(self) -> dict[str, Any]:
        return {
            "statuses": list(self.statuses),
            "event_type": self.event_type,
            "app_code": self.app_code,
            "room_id": self.room_id,
            "older_than_ms": self.older_than_ms,
            "newer_than_ms": self.newer_than_ms,
            "error_contains": self.error_contains,
        }


@dataclass(frozen=True, slots=True)
class OutboxStats:
    now_ms: int
    counts: dict[str, int]  # every status word (zeros included), plus any unexpected word found
    total: int
    oldest_pending_age_ms: int | None  # since due_at_ms (creation, or the replay that requeued it)
    oldest_retryable_age_ms: int | None  # since created_at_ms

    def to_dict(self) -> dict[str, Any]:
        return {
            "now_ms": self.now_ms,
            "counts": dict(self.counts),
            "legacy_statuses": sorted(LEGACY_STATUSES),
            "total": self.total,
            "oldest_pending_age_ms": self.oldest_pending_age_ms,
            "oldest_retryable_age_ms": self.oldest_retryable_age_ms,
        }


@dataclass(frozen=True, slots=True)
class OutboxRowView:
    """One row without its payload."""

    id: int
    event_id: str
    app_code: str
    room_id: str
    room_version: int
    event_type: str
    status: str
    retry_count: int
    replay_count: int
    next_retry_at_ms: int | None
    lock_until_ms: int | None
    lock_owner: str | None
    last_error: str | None
    targets_done: tuple[str, ...]
    due_at_ms: int
    created_at_ms: int
    updated_at_ms: int
    delivered_at_ms: int | None
    age_ms: int  # now - created_at_ms
    trace_context: str | None = None  # the committing command's W3C traceparent (tracing on)

    @property
    def trace_id(self) -> str | None:
        """The trace to look up in the tracing backend (docs/tracing.md), from ``trace_context``."""
        parts = (self.trace_context or "").split("-")
        return parts[1] if len(parts) == 4 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "event_id": self.event_id,
            "app_code": self.app_code,
            "room_id": self.room_id,
            "room_version": self.room_version,
            "event_type": self.event_type,
            "status": self.status,
            "retry_count": self.retry_count,
            "replay_count": self.replay_count,
            "next_retry_at_ms": self.next_retry_at_ms,
            "lock_until_ms": self.lock_until_ms,
            "lock_owner": self.lock_owner,
            "last_error": self.last_error,
            "targets_done": list(self.targets_done),
            "due_at_ms": self.due_at_ms,
            "created_at_ms": self.created_at_ms,
            "updated_at_ms": self.updated_at_ms,
            "delivered_at_ms": self.delivered_at_ms,
            "age_ms": self.age_ms,
            "trace_context": self.trace_context,
        }


@dataclass(frozen=True, slots=True)
class AuditRecord:
    id: int
    event_id: str
    action: str
    actor: str
    detail: str | None
    created_at_ms: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "event_id": self.event_id,
            "action": self.action,
            "actor": self.actor,
            "detail": self.detail,
            "created_at_ms": self.created_at_ms,
        }


@dataclass(frozen=True, slots=True)
class OutboxRowDetail:
    """Every column, the decoded event and the row's audit trail (oldest first)."""

    row: OutboxRowView
    payload: bytes
    event: dict[str, Any] | None  # decode_event(payload).to_dict(); None when it does not decode
    decode_error: str | None
    audit: list[AuditRecord]

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.row.to_dict(),
            "payload_size": len(self.payload),
            "payload_base64": base64.b64encode(self.payload).decode("ascii"),
            "event": self.event,
            "decode_error": self.decode_error,
            "audit": [a.to_dict() for a in self.audit],
        }


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    event_id: str
    result: ReplayResult
    message: str
    status: str | None = None  # the row's status before the call (None: no such row)
    new_event_id: str | None = None  # as_repair: the repair event written
    targets: tuple[str, ...] | None = None  # as_repair: what the repair is sent to (those the mode routes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "result": self.result,
            "status": self.status,
            "new_event_id": self.new_event_id,
            "targets": None if self.targets is None else list(self.targets),
            "message": self.message,
        }


@dataclass(slots=True)
class ReplayReport:
    as_repair: bool
    outcomes: list[ReplayOutcome] = field(default_factory=list)
    targets: frozenset[str] | None = None  # the targets named for a repair (None: its default)

    def _count(self, result: ReplayResult) -> int:
        return sum(1 for o in self.outcomes if o.result == result)

    @property
    def replayed(self) -> int:
        return self._count("replayed")

    @property
    def not_found(self) -> int:
        return self._count("not_found")

    @property
    def not_failed(self) -> int:
        return self._count("not_failed")

    @property
    def undecodable(self) -> int:
        return self._count("undecodable")

    @property
    def no_targets(self) -> int:
        return self._count("no_targets")

    @property
    def already_repaired(self) -> int:
        return self._count("already_repaired")

    def to_dict(self) -> dict[str, Any]:
        return {
            "as_repair": self.as_repair,
            "targets": None if self.targets is None else sorted(self.targets),
            "total": len(self.outcomes),
            "replayed": self.replayed,
            "not_found": self.not_found,
            "not_failed": self.not_failed,
            "undecodable": self.undecodable,
            "no_targets": self.no_targets,
            "already_repaired": self.already_repaired,
            "results": [o.to_dict() for o in self.outcomes],
        }


class ReplayInterrupted(errors.Unavailable):
    """A batch failed after earlier batches of the same replay committed: ``report`` holds theirs."""

    def __init__(self, report: ReplayReport, cause: errors.RoomServiceError, *, total: int) -> None:
        self.report = report
        self.cause = cause
        done = len(report.outcomes)
        super().__init__(
            f"replay stopped after {done} of {total} row(s): {cause.message}; the rows reported are done, "
            "the batch in flight may or may not be: run the same replay again to go on"
        )

    def to_body(self) -> dict[str, Any]:
        return {**super().to_body(), "report": self.report.to_dict()}


# --------------------------------------------------------------------------- statements

_o, _a = room_outbox, room_outbox_audit
_FAILED: Final = Status.FAILED.value
_PENDING: Final = Status.PENDING.value

_AnySelect: TypeAlias = Select[*tuple[Any, ...]]
_AnyRow: TypeAlias = Row[*tuple[Any, ...]]

# (statuses, event_type, app_code, room_id, older_than, newer_than, error): which criteria are present
_Shape = tuple[bool, bool, bool, bool, bool, bool, bool]

_VIEW_COLUMNS: Final = tuple(c for c in _o.c if c.name != "payload")

_COUNT_BY_STATUS: Final = select(_o.c.status, func.count()).group_by(_o.c.status)
_OLDEST_PENDING_DUE: Final = select(func.min(_o.c.due_at_ms)).where(_o.c.status == _PENDING)
_OLDEST_RETRYABLE: Final = select(func.min(_o.c.created_at_ms)).where(_o.c.status == Status.RETRYABLE.value)

_SHOW_ROW: Final = select(_o).where(_o.c.event_id == bindparam("event_id"))
_SHOW_AUDIT: Final = select(_a).where(_a.c.event_id == bindparam("event_id")).order_by(_a.c.id)
_REPAIRED: Final = (
    select(_a.c.event_id).where(_a.c.action == "repair", _a.c.event_id.in_(bindparam("event_ids", expanding=True)))
).distinct()

_LOCK_BY_EVENT_IDS: Final = (
    select(_o).where(_o.c.event_id.in_(bindparam("event_ids", expanding=True))).with_for_update()
)
_REQUEUE: Final = (
    update(_o)
    .where(_o.c.id.in_(bindparam("ids", expanding=True)), _o.c.status == _FAILED)
    .values(
        status=_PENDING,
        retry_count=0,
        replay_count=_o.c.replay_count + 1,
        next_retry_at_ms=None,
        lock_until_ms=None,
        lock_owner=None,
        last_error=None,
        due_at_ms=bindparam("now_ms"),
        updated_at_ms=bindparam("now_ms"),
    )
)
_INSERT_OUTBOX: Final = insert(_o)
_INSERT_AUDIT: Final = insert(_a)


@functools.cache
def _conditions(shape: _Shape) -> tuple[ColumnElement[bool], ...]:
    statuses, event_type, app_code, room_id, older, newer, error = shape
    conds: list[ColumnElement[bool]] = []
    if statuses:
        conds.append(_o.c.status.in_(bindparam("f_statuses", expanding=True)))
    if event_type:
        conds.append(_o.c.event_type == bindparam("f_event_type"))
    if app_code:
        conds.append(_o.c.app_code == bindparam("f_app_code"))
    if room_id:
        conds.append(_o.c.room_id == bindparam("f_room_id"))
    if older:
        conds.append(_o.c.created_at_ms <= bindparam("f_created_max"))
    if newer:
        conds.append(_o.c.created_at_ms >= bindparam("f_created_min"))
    if error:
        conds.append(func.lower(_o.c.last_error).like(bindparam("f_error_like"), escape="!"))
    return tuple(conds)


@functools.cache
def _list_statement(shape: _Shape, newest_first: bool = False) -> _AnySelect:
    if newest_first:
        return select(*_VIEW_COLUMNS).where(*_conditions(shape)).order_by(_o.c.id.desc()).limit(bindparam("limit"))
    return (
        select(*_VIEW_COLUMNS)
        .where(*_conditions(shape), _o.c.id > bindparam("after_id"))
        .order_by(_o.c.id)
        .limit(bindparam("limit"))
    )


@functools.cache
def _count_statement(shape: _Shape) -> _AnySelect:
    return select(func.count(), func.max(_o.c.id)).select_from(_o).where(*_conditions(shape))


@functools.cache
def _bulk_batch_statement(shape: _Shape) -> _AnySelect:
    """The next batch of matching rows of a bulk replay, locked: id in (after_id, max_id]."""
    return (
        select(_o)
        .where(*_conditions(shape), _o.c.id > bindparam("after_id"), _o.c.id <= bindparam("max_id"))
        .order_by(_o.c.id)
        .limit(bindparam("limit"))
        .with_for_update()
    )


def _escape_like(text: str) -> str:
    return text.replace("!", "!!").replace("%", "!%").replace("_", "!_")


# --------------------------------------------------------------------------- the service


class OutboxAdmin:
    """Dead-letter operations on ``room_outbox``; ``clock`` gives "now" in epoch ms.

    ``on_requeued`` (optional) is called after a replay committed new work
    (requeued rows or repair rows): wire the local worker's wake-up to it.
    """

    def __init__(
        self,
        db: Database,
        *,
        clock: Callable[[], int],
        on_requeued: Callable[[], None] | None = None,
    ) -> None:
        self.db = db
        self.clock = clock
        self.on_requeued = on_requeued

    # ---- reads

    async def stats(self) -> OutboxStats:
        now_ms = self.clock()
        counts, oldest_pending_due, oldest_retryable = await self.db.run_long_read(_read_stats)
        merged = {status: 0 for status in ALL_STATUSES}
        merged.update(counts)
        return OutboxStats(
            now_ms=now_ms,
            counts=merged,
            total=sum(merged.values()),
            oldest_pending_age_ms=None if oldest_pending_due is None else max(0, now_ms - oldest_pending_due),
            oldest_retryable_age_ms=None if oldest_retryable is None else max(0, now_ms - oldest_retryable),
        )

    async def list(
        self,
        filter: OutboxFilter | None = None,
        *,
        limit: int = 50,
        after_id: int | None = None,
        newest_first: bool = False,
    ) -> list[OutboxRowView]:
        """Matching rows ordered by id; the next page starts after the last id returned.

        ``newest_first``: the newest ``limit`` matching rows, newest first (no paging: ``after_id`` must be None).
        """
        flt = (filter or OutboxFilter()).validated()
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise errors.InvalidArgument(f"limit must be 1..{MAX_LIST_LIMIT}")
        if after_id is not None and not 0 <= after_id <= MAX_ID_VALUE:
            raise errors.InvalidArgument(f"after_id must be 0..{MAX_ID_VALUE}")  # SQLite: OverflowError beyond
        if newest_first and after_id is not None:
            raise errors.InvalidArgument("after_id pages oldest first; newest_first takes none")
        now_ms = self.clock()
        params = {**flt._params(now_ms), "after_id": after_id or 0, "limit": limit}
        rows = await self.db.run_long_read(_all, _list_statement(flt._shape(), newest_first), params)
        return [_view(r, now_ms) for r in rows]

    async def count(self, filter: OutboxFilter | None = None) -> int:
        flt = (filter or OutboxFilter()).validated()
        total, _max_id = await self.db.run_long_read(_one, _count_statement(flt._shape()), flt._params(self.clock()))
        return int(total or 0)

    async def show(self, event_id: str) -> OutboxRowDetail:
        """One row with its decoded event and audit trail; :class:`errors.NotFound` for an id no row
        has, :class:`errors.InvalidArgument` for one no row can have (:func:`check_event_ids`)."""
        check_event_ids([event_id])
        now_ms = self.clock()
        row, audit = await self.db.run_read(_read_show, event_id)
        if row is None:
            raise errors.NotFound(f"no outbox row with event_id {event_id}")
        payload = bytes(row.payload)
        event: dict[str, Any] | None = None
        decode_error: str | None = None
        try:
            event = wire.decode_event(payload).to_dict()
        except Exception as exc:  # a poison payload is exactly what an admin wants to look at
            decode_error = f"{type(exc).__name__}: {exc}"
        return OutboxRowDetail(
            row=_view(row, now_ms),
            payload=payload,
            event=event,
            decode_error=decode_error,
            audit=[_audit(a) for a in audit],
        )

    # ---- replay

    async def replay(
        self,
        event_ids: Sequence[str],
        *,
        actor: str,
        as_repair: bool = False,
        targets: Iterable[str] | None = None,
        batch_size: int = 100,
        progress: Callable[[int, int], None] | None = None,
    ) -> ReplayReport:
        """Replay the ``failed`` rows among ``event_ids``; every id gets an outcome, in input order.

        ``targets`` (repair only; names of :data:`REPAIR_TARGETS`, comma lists allowed):
        what the repair is sent to; ``None`` sends it where the original had not succeeded.
        ``progress(done, total)``: as for :meth:`replay_matching`. An id outside the event id
        pattern fails the whole call before any batch (:func:`check_event_ids`): nothing is replayed.
        """
        _check_batch_size(batch_size)
        ids = list(dict.fromkeys(event_ids))
        check_event_ids(ids, name="event_ids")
        actor = _actor(actor)
        chosen = repair_targets(targets, as_repair=as_repair)
        report = ReplayReport(as_repair=as_repair, targets=chosen)
        if progress is not None:
            progress(0, len(ids))
        for start in range(0, len(ids), batch_size):
            chunk = ids[start : start + batch_size]
            with _interruption(report, total=len(ids)):
                outcomes = await self.db.run_long_write(
                    _replay_ids, chunk, self.clock(), actor, _Mode(as_repair, chosen)
                )
            report.outcomes.extend(outcomes)
            self._notify(outcomes)
            if progress is not None:
                progress(len(report.outcomes), len(ids))
        return report

    async def record_audit(self, entries: Sequence[tuple[str, dict[str, Any]]], *, action: str, actor: str) -> None:
        """Audit an action taken elsewhere (a consumer group's dead-letter replay): one row per
        ``(event_id, detail)``, in one transaction."""
        if not entries:
            return
        actor = _actor(actor)
        now_ms = self.clock()
        rows = [_audit_row(event_id[:64], action, actor, now_ms, **detail) for event_id, detail in entries]
        await self.db.run_write(_insert_audit, rows)

    async def replay_matching(
        self,
        filter: OutboxFilter | None = None,
        *,
        actor: str,
        as_repair: bool = False,
        targets: Iterable[str] | None = None,
        batch_size: int = 100,
        progress: Callable[[int, int], None] | None = None,
    ) -> ReplayReport:
        """Replay every ``failed`` row matching ``filter``, one transaction per batch.

        The set is fixed when the call starts (ages relative to that moment,
        ids up to the highest matching one then); ``progress(done, total)`` is
        called once before the first batch and after each batch. ``targets``: as
        for :meth:`replay`.
        """
        _check_batch_size(batch_size)
        chosen = repair_targets(targets, as_repair=as_repair)
        flt = filter or OutboxFilter()
        if any(s != _FAILED for s in flt.statuses):
            raise errors.InvalidArgument("replay only takes failed rows: the status filter must be 'failed'")
        flt = replace(flt, statuses=(_FAILED,)).validated()
        actor = _actor(actor)
        now_ms = self.clock()
        shape, params = flt._shape(), flt._params(now_ms)
        total_raw, max_id = await self.db.run_long_read(_one, _count_statement(shape), params)
        total = int(total_raw or 0)
        report = ReplayReport(as_repair=as_repair, targets=chosen)
        if progress is not None:
            progress(0, total)
        if not total or max_id is None:
            return report
        statement = _bulk_batch_statement(shape)
        after_id = 0
        while True:
            batch_params = {**params, "after_id": after_id, "max_id": int(max_id), "limit": batch_size}
            with _interruption(report, total=total):
                outcomes, last_id = await self.db.run_long_write(
                    _replay_next_batch, statement, batch_params, self.clock(), actor,
                    _Mode(as_repair, chosen, skip_repaired=True),
                )
            if last_id is None:
                break
            after_id = last_id
            report.outcomes.extend(outcomes)
            self._notify(outcomes)
            if progress is not None:
                progress(min(len(report.outcomes), total), total)
        return report

    def _notify(self, outcomes: Iterable[ReplayOutcome]) -> None:
        if self.on_requeued is not None and any(o.result == "replayed" for o in outcomes):
            self.on_requeued()


@contextlib.contextmanager
def _interruption(report: ReplayReport, *, total: int) -> Iterator[None]:
    """A batch's failure after earlier batches committed is :class:`ReplayInterrupted` with their report."""
    try:
        yield
    except (errors.Unavailable, errors.Retry) as exc:
        if not report.outcomes:
            raise
        raise ReplayInterrupted(report, exc, total=total) from exc


# --------------------------------------------------------------------------- units (run in one hop)


def _all(conn: Connection, statement: _AnySelect, params: dict[str, Any]) -> list[_AnyRow]:
    return list(conn.execute(statement, params).all())


def _one(conn: Connection, statement: _AnySelect, params: dict[str, Any]) -> _AnyRow:
    return conn.execute(statement, params).one()


def _insert_audit(conn: Connection, rows: list[dict[str, Any]]) -> None:
    conn.execute(_INSERT_AUDIT, rows)


def _read_stats(conn: Connection) -> tuple[dict[str, int], int | None, int | None]:
    counts = {str(status): int(n) for status, n in conn.execute(_COUNT_BY_STATUS).all()}
    oldest_pending = conn.scalar(_OLDEST_PENDING_DUE)
    oldest_retryable = conn.scalar(_OLDEST_RETRYABLE)
    return (
        counts,
        None if oldest_pending is None else int(oldest_pending),
        None if oldest_retryable is None else int(oldest_retryable),
    )


def _read_show(conn: Connection, event_id: str) -> tuple[_AnyRow | None, list[_AnyRow]]:
    row = conn.execute(_SHOW_ROW, {"event_id": event_id}).one_or_none()
    if row is None:
        return None, []
    return row, list(conn.execute(_SHOW_AUDIT, {"event_id": event_id}).all())


@dataclass(frozen=True, slots=True)
class _Mode:
    """How a replay treats its rows: requeue, or repair (to the named targets, or by default)."""

    as_repair: bool
    targets: frozenset[str] | None = None
    # a repair by filter leaves originals repaired before (a run again, or resumed after a failed batch,
    # writes no second repair of each); named ids are repaired again, as asked
    skip_repaired: bool = False


def repair_targets(targets: Iterable[str] | None, *, as_repair: bool) -> frozenset[str] | None:
    """The validated targets of a replay: :func:`parse_repair_targets`, and only for a repair."""
    chosen = parse_repair_targets(targets)
    if chosen is not None and not as_repair:
        raise errors.InvalidArgument(
            "targets apply to a repair only (as_repair): a plain replay sends what the row has not delivered"
        )
    return chosen


def _replay_ids(conn: Connection, event_ids: list[str], now_ms: int, actor: str, mode: _Mode) -> list[ReplayOutcome]:
    found = {r.event_id: r for r in conn.execute(_LOCK_BY_EVENT_IDS, {"event_ids": event_ids}).all()}
    failed = [found[i] for i in event_ids if i in found and found[i].status == _FAILED]
    applied = {o.event_id: o for o in _apply(conn, failed, now_ms, actor, mode)}
    outcomes: list[ReplayOutcome] = []
    for event_id in event_ids:
        row = found.get(event_id)
        if row is None:
            outcomes.append(ReplayOutcome(event_id, "not_found", f"no outbox row with event_id {event_id}"))
        elif row.status != _FAILED:
            outcomes.append(
                ReplayOutcome(
                    event_id,
                    "not_failed",
                    f"{event_id} is {row.status}, not failed: only failed rows are replayed",
                    status=row.status,
                )
            )
        else:
            outcomes.append(applied[event_id])
    return outcomes


def _replay_next_batch(
    conn: Connection, statement: _AnySelect, params: dict[str, Any], now_ms: int, actor: str, mode: _Mode
) -> tuple[list[ReplayOutcome], int | None]:
    rows = list(conn.execute(statement, params).all())
    if not rows:
        return [], None
    return _apply(conn, rows, now_ms, actor, mode), int(rows[-1].id)


def _apply(conn: Connection, rows: Sequence[_AnyRow], now_ms: int, actor: str, mode: _Mode) -> list[ReplayOutcome]:
    """Replay locked ``failed`` rows: requeue them, or write repair rows; audit either way."""
    if not rows:
        return []
    if mode.as_repair:
        return _repair(conn, rows, now_ms, actor, mode)
    changed = conn.execute(_REQUEUE, {"ids": [r.id for r in rows], "now_ms": now_ms}).rowcount
    if changed != len(rows):  # the rows are locked: only a concurrent writer ignoring locks gets here
        raise errors.Retry("outbox rows changed during the replay; nothing was replayed, retry")
    conn.execute(
        _INSERT_AUDIT,
        [
            _audit_row(
                r.event_id,
                "replay",
                actor,
                now_ms,
                previous_retry_count=r.retry_count,
                previous_last_error=r.last_error,
                replay_count=r.replay_count + 1,
                targets_done=r.targets_done,
            )
            for r in rows
        ],
    )
    return [
        ReplayOutcome(
            r.event_id,
            "replayed",
            f"{r.event_id} requeued (replay #{r.replay_count + 1}, was retry_count {r.retry_count})",
            status=_FAILED,
        )
        for r in rows
    ]


def _repair(conn: Connection, rows: Sequence[_AnyRow], now_ms: int, actor: str, mode: _Mode) -> list[ReplayOutcome]:
    named = mode.targets
    outcomes: list[ReplayOutcome] = []
    if mode.skip_repaired:
        repaired = set(conn.execute(_REPAIRED, {"event_ids": [r.event_id for r in rows]}).scalars())
        outcomes.extend(
            ReplayOutcome(
                r.event_id,
                "already_repaired",
                f"{r.event_id} was repaired before (see its audit): no second repair by filter; "
                "name its id to repair it again",
                status=_FAILED,
            )
            for r in rows
            if r.event_id in repaired
        )
        rows = [r for r in rows if r.event_id not in repaired]
    new_rows: list[dict[str, Any]] = []
    audits: list[dict[str, Any]] = []
    for r in rows:
        try:
            original = wire.decode_event(bytes(r.payload))
        except Exception as exc:
            outcomes.append(
                ReplayOutcome(
                    r.event_id,
                    "undecodable",
                    f"{r.event_id}: payload does not decode ({type(exc).__name__}); no repair event written",
                    status=_FAILED,
                )
            )
            continue
        routable = _routable(r.event_type)
        succeeded = parse_targets(r.targets_done or "") & routable
        chosen = (routable - succeeded if named is None else named) & routable
        if not chosen:
            outcomes.append(
                ReplayOutcome(r.event_id, "no_targets", _no_targets_message(r, named, routable), status=_FAILED)
            )
            continue
        new_id = new_event_id()
        repair_of = dedup_id(original)  # a repair of a repair still names the first event
        sent_to = tuple(sorted(chosen))
        new_rows.append(
            {
                "event_id": new_id,
                "app_code": r.app_code,
                "room_id": r.room_id,
                "room_version": r.room_version,
                "event_type": r.event_type,
                "payload": wire.encode_event(replace(original, event_id=new_id, repair_of=repair_of)),
                "status": _PENDING,
                "retry_count": 0,
                "replay_count": 0,
                # the worker sends required_targets - targets_done: mark every target but the chosen done
                "targets_done": format_targets(routable - chosen),
                "due_at_ms": now_ms,
                "created_at_ms": now_ms,
                "updated_at_ms": now_ms,
                "trace_context": r.trace_context,  # the repair's delivery joins the original's trace
            }
        )
        audits.append(
            _audit_row(
                r.event_id,
                "repair",
                actor,
                now_ms,
                repair_event_id=new_id,
                targets=list(sent_to),
                targets_named=named is not None,
                previous_retry_count=r.retry_count,
                previous_last_error=r.last_error,
                note=f"repair event {new_id} written; this row stays failed",
            )
        )
        audits.append(
            _audit_row(
                new_id,
                "repair_of",
                actor,
                now_ms,
                original_event_id=r.event_id,
                repair_of=repair_of,
                targets=list(sent_to),
                targets_named=named is not None,
                note=(
                    f"repair event re-sending {r.event_id} (failed) under a new event_id to {', '.join(sent_to)}; "
                    "targets_done starts with the targets it is not sent to"
                ),
            )
        )
        outcomes.append(
            ReplayOutcome(
                r.event_id,
                "replayed",
                f"{r.event_id} repaired: new event {new_id} queued for {', '.join(sent_to)}, the original stays failed",
                status=_FAILED,
                new_event_id=new_id,
                targets=sent_to,
            )
        )
    if new_rows:
        conn.execute(_INSERT_OUTBOX, new_rows)
        conn.execute(_INSERT_AUDIT, audits)
    return outcomes


def _no_targets_message(r: _AnyRow, named: frozenset[str] | None, routable: frozenset[str]) -> str:
    if named is None:
        return (
            f"{r.event_id}: every target of {r.event_type} ({', '.join(sorted(routable)) or 'none'}) succeeded "
            "for the original; no repair event written (name targets to send it again)"
        )
    return (
        f"{r.event_id}: {r.event_type} has none of the targets named ({', '.join(sorted(named))}; "
        f"its targets: {', '.join(sorted(routable)) or 'none'}); no repair event written"
    )


# --------------------------------------------------------------------------- rows


def _audit_row(event_id: str, action: str, actor: str, now_ms: int, **detail: Any) -> dict[str, Any]:
    return {
        "event_id": event_id,
        "action": action,
        "actor": actor,
        "detail": json.dumps(detail, separators=(",", ":"), ensure_ascii=False),
        "created_at_ms": now_ms,
    }


def _view(r: _AnyRow, now_ms: int) -> OutboxRowView:
    return OutboxRowView(
        id=int(r.id),
        event_id=r.event_id,
        app_code=r.app_code,
        room_id=r.room_id,
        room_version=int(r.room_version),
        event_type=r.event_type,
        status=r.status,
        retry_count=int(r.retry_count),
        replay_count=int(r.replay_count),
        next_retry_at_ms=_opt_int(r.next_retry_at_ms),
        lock_until_ms=_opt_int(r.lock_until_ms),
        lock_owner=r.lock_owner,
        last_error=r.last_error,
        targets_done=tuple(t for t in (r.targets_done or "").split(",") if t),
        due_at_ms=int(r.due_at_ms),
        created_at_ms=int(r.created_at_ms),
        updated_at_ms=int(r.updated_at_ms),
        delivered_at_ms=_opt_int(r.delivered_at_ms),
        age_ms=max(0, now_ms - int(r.created_at_ms)),
        trace_context=r.trace_context,
    )


def _audit(r: _AnyRow) -> AuditRecord:
    return AuditRecord(
        id=int(r.id),
        event_id=r.event_id,
        action=r.action,
        actor=r.actor,
        detail=r.detail,
        created_at_ms=int(r.created_at_ms),
    )


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _actor(actor: str) -> str:
    actor = actor.strip()
    if not actor:
        raise errors.InvalidArgument("actor must not be empty")
    return actor[:_ACTOR_MAX]


def _check_batch_size(batch_size: int) -> None:
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise errors.InvalidArgument(f"batch_size must be 1..{MAX_BATCH_SIZE}")
