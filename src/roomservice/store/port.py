"""The room store port: what the Room Cell needs from durable storage.

Adapters: :class:`roomservice.store.sql.SqlRoomStore` (SQLite and MySQL/MariaDB
through SQLAlchemy Core). Tests use the same adapter on SQLite; there is no
separate fake because an on-disk SQLite store is fast enough.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from roomservice import errors
from roomservice.domain.events import Event
from roomservice.domain.state import RoomState

if TYPE_CHECKING:
    from sqlalchemy.engine import Dialect


class StoreConflict(errors.Retry):
    """SaveMutation lost a race: the stored version or lease epoch moved on.

    The command was not written; the caller answers ``503 retry`` and reloads.
    """


class StoreUnavailable(errors.Unavailable):
    """The database did not answer (connection lost, pool exhausted, deadlock).

    For a write the outcome is unknown: it may have committed. The caller
    answers ``503 unavailable`` and reloads the room before trusting its state.
    """


class StoreDeadlineExceeded(StoreUnavailable):
    """A database call did not finish within its deadline (``database.timeout``).

    Its connection was discarded, never pooled again; a write's outcome is unknown.
    """


class StoreInconsistent(errors.RoomServiceError):
    """Rows that recovery depends on disagree (room_meta vs snapshot + log): refuse to serve the room."""

    code = "store_inconsistent"


class CommandIdTaken(StoreConflict):
    """Another writer logged the same command_id first (read it back with find_command)."""


class NeedsOwnTransaction(Exception):
    """An :class:`AttachedWrite` in a shared transaction could not finish without leaving rows
    behind: that transaction is rolled back and each of its mutations is retried in its own."""


class Writes(Protocol):
    """Where a write unit's statements go (:mod:`roomservice.store.writes`): the driver's cursor of
    a MySQL/MariaDB unit, or a SQLite unit's. Statements are built once (module constants) and need
    no type processing; the methods are awaited, and on SQLite never wait."""

    @property
    def dialect(self) -> Dialect: ...

    async def execute_rendered(self, statement: Any, params: dict[str, Any]) -> int:
        """Run ``statement`` (no expanding ``IN``) with every parameter given; the rows it matched."""
        ...

    async def insert_rows(self, insert: Any, rows: Sequence[dict[str, Any]]) -> None:
        """Insert ``rows`` (each with the first one's keys) by ``insert``."""
        ...

    async def rows(self, statement: Any, params: dict[str, Any]) -> Sequence[tuple[Any, ...]]:
        """The rows of the query ``statement``, as the driver's tuples."""
        ...


class AttachedWrite(Protocol):
    """A write of another module that commits with a mutation or not at all: the embedded
    wallet's debit of a gift, in the command's own transaction, so that no debit exists
    without its command and no command without its debit.

    It runs before the mutation's rows, in the order of ``lock_order`` among the attached
    writes of a shared transaction (before any room row: on MySQL/MariaDB every transaction
    takes its row locks in one global order, so two never wait for each other crosswise).
    """

    @property
    def lock_order(self) -> tuple[str, ...]: ...

    async def write(self, writes: Writes, *, shared: bool) -> None:
        """Write it through ``writes`` (the mutation's transaction). ``shared``: other mutations are
        in the transaction too; then raise either a :class:`~roomservice.errors.RoomServiceError`
        having written nothing (the mutation fails alone with it, the others commit) or
        :class:`NeedsOwnTransaction`. Alone, whatever it raises rolls back the whole mutation and
        fails it."""
        ...

    def committed(self) -> None:
        """Called once the transaction that carried it has committed."""
        ...


class Answer(dict[str, Any]):
    """A command's answer body with its compact JSON (``orjson.dumps`` of it), encoded once: the
    command log row stores that text and the HTTP fast path sends those bytes, so both are the
    same bytes. Built whole and never changed afterwards (the encoding would go stale)."""

    __slots__ = ("encoded",)

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.encoded: bytes = orjson.dumps(body)

    def __reduce__(self) -> tuple[type[Answer], tuple[dict[str, Any]]]:  # copy, deepcopy, pickle
        return Answer, (dict(self),)


@dataclass(frozen=True, slots=True)
class LoggedCommand:
    """What idempotency needs of a command already committed."""

    command_id: str
    fingerprint: str
    response: dict[str, Any]
    version: int
    command_type: str | None = None  # as logged (the store's look-up says; a cell's memory need not)


@dataclass(frozen=True, slots=True)
class LoadedRoom:
    """A room as recovery found it: newest snapshot plus the logged events after it."""

    state: RoomState | None
    epoch: int
    snapshot_version: int
    replayed_events: int


@dataclass(frozen=True, slots=True)
class Mutation:
    """One committed command: the command log row, its outbox rows and the new room meta.

    ``expected_version`` is the version the cell decided on (0 for CreateRoom);
    ``epoch`` is the cell's lease epoch. A no-op command has no events and
    ``state_after.version == expected_version``. ``attached``: a write that commits
    with this mutation or not at all (a gift's embedded debit).
    """

    app_code: str
    room_id: str
    command_id: str
    command_type: str
    fingerprint: str
    command: dict[str, Any]
    events: tuple[Event, ...]
    response: dict[str, Any]
    now_ms: int
    expected_version: int
    epoch: int
    state_after: RoomState | None
    trace_context: str | None = None  # W3C traceparent of the command, stored with its outbox rows
    timing: Mapping[str, float | bool] | None = None  # stored with the command log row (room inspector)
    attached: AttachedWrite | None = None


@dataclass(frozen=True, slots=True)
class RoomSummary:
    """A room_meta row, for seeding the room list projection."""

    app_code: str
    room_id: str
    owner_id: str
    title: str
    status: str
    version: int
    member_count: int
    heat: int
    updated_at_ms: int


class RoomStore(Protocol):
    async def find_command(self, app_code: str, room_id: str, command_id: str) -> LoggedCommand | None:
        """The logged command with this id in this room, if any."""
        ...

    async def take_lease_epoch(self, app_code: str, room_id: str) -> int:
        """Bump and return the room's durable fencing epoch (0 when the room does not exist yet)."""
        ...

    async def load_room(self, app_code: str, room_id: str) -> LoadedRoom:
        """Newest snapshot + the logged events after it, applied through ``evolve``."""
        ...

    async def save_mutation(self, mutation: Mutation) -> None:
        """ONE transaction: command log row + outbox rows + room meta, guarded by version and epoch,
        and the mutation's attached write.

        Raises :class:`StoreConflict` (nothing written) when the stored version
        is not ``expected_version`` or the epoch is not current,
        :class:`CommandIdTaken` when the command_id is already logged, and whatever
        the attached write failed with (nothing written).
        """
        ...

    async def save_snapshot(self, state: RoomState, *, now_ms: int) -> None:
        """Store a snapshot of ``state`` (idempotent per version) and prune older ones."""
        ...

    async def list_room_summaries(self, *, limit: int) -> list[RoomSummary]:
        """The meta rows of open rooms, newest first, for seeding and rebuilding projections."""
        ...

    async def prune_command_log(self, *, before_ms: int, batch_size: int) -> int:
        """Delete up to ``batch_size`` idempotency rows created before ``before_ms`` that a
        snapshot already covers (recovery never needs them); returns how many went."""
        ...

    async def snapshot_uncovered(self, *, before_ms: int, limit: int, now_ms: int) -> int:
        """Snapshot up to ``limit`` rooms that have rows created before ``before_ms`` no snapshot
        covers, so that :meth:`prune_command_log` can take them; returns how many rooms it took up."""
        ...

    async def ping(self) -> None:
        """Raise if the database does not answer."""
        ...
