"""A consumer group's dead letters (SPEC §5): lag and dead letters per group, and their audited replay.

The broker port keeps the dead letters per group (:meth:`Broker.dead_letters`,
:meth:`Broker.replay_dead_letter`); this adds what an operator's replay needs
around it: only the groups this configuration runs, and an audit row per
replayed message (action ``consumer_replay``, keyed by the message's key, which
is the event id), in ``room_outbox_audit`` beside the outbox replays of the
same event. :func:`describe` is one dead letter in full, its body decoded:
the ``room_outbox_event`` envelope, or a treasure wake-up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from roomservice import errors
from roomservice.admin.operations import OutboxAdmin
from roomservice.bootstrap.broker import GroupSpec, consumer_groups
from roomservice.brokers.port import Broker, DeadLetter, GroupStats
from roomservice.timers.delay_message import WAKEUP_TAG, TreasureWakeup
from roomservice.wire import decode_event

if TYPE_CHECKING:
    from roomservice.bootstrap.process import Process

MAX_DEAD_LETTERS = 10_000
AUDIT_CHUNK = 100  # replayed dead letters audited together (as they go, not all at the end)


class AuditNotWritten(errors.Unavailable):
    """Dead letters were replayed (for good) and their audit rows could not be written; the message names them."""


@dataclass(frozen=True, slots=True)
class GroupReport:
    spec: GroupSpec
    stats: GroupStats | None
    error: str | None  # the broker did not answer: why


def group_row(spec: GroupSpec, stats: GroupStats | None) -> dict[str, Any]:
    """One group as ``room-service broker groups --json`` and ``GET /admin/consumers`` show it
    (the broker's figures None when it did not answer)."""
    return {
        "group": spec.group,
        "topic": spec.topic,
        "lag": stats.lag if stats else None,
        "in_flight": stats.in_flight if stats else None,
        "dead_letters": stats.dead_letters if stats else None,
        "max_deliveries": spec.max_deliveries,
    }


@dataclass(frozen=True, slots=True)
class DeadLetterReplay:
    group: str
    replayed: tuple[str, ...]
    not_dead_letters: tuple[str, ...]


class DeadLetterAdmin:
    def __init__(self, broker: Broker, groups: Sequence[GroupSpec], *, audit: OutboxAdmin) -> None:
        self.broker = broker
        self.groups = list(groups)
        self.audit = audit

    @classmethod
    def of_process(cls, process: Process) -> DeadLetterAdmin | None:
        """The groups of ``process``'s configuration on its broker; None when it has no broker."""
        if process.broker is None:
            return None
        assert process.outbox_admin is not None  # every process builds the admin operations
        return cls(process.broker, consumer_groups(process.settings), audit=process.outbox_admin)

    def group(self, name: str) -> GroupSpec:
        """The group of this configuration named ``name``; :class:`errors.NotFound` naming the known ones."""
        for spec in self.groups:
            if spec.group == name:
                return spec
        known = ", ".join(g.group for g in self.groups) or "none (no consumer group is enabled)"
        raise errors.NotFound(f"unknown consumer group {name[:80]!r}; this configuration runs: {known}")

    async def reports(self) -> list[GroupReport]:
        """Every group's stats; a broker that does not answer gives the error instead of failing the rest."""
        out = []
        for spec in self.groups:
            try:
                out.append(GroupReport(spec, await self.broker.group_stats(spec.topic, spec.group), None))
            except errors.RoomServiceError as exc:
                out.append(GroupReport(spec, None, str(exc)[:300]))
        return out

    async def dead_letters(self, group: str, *, limit: int = 100) -> Sequence[DeadLetter]:
        if not 1 <= limit <= MAX_DEAD_LETTERS:
            raise errors.InvalidArgument(f"limit must be 1..{MAX_DEAD_LETTERS}")
        return await self.broker.dead_letters(self.group(group).group, limit=limit)

    async def dead_letter(self, group: str, message_id: str) -> DeadLetter:
        """One dead letter of ``group``; :class:`errors.NotFound` if it is none (the port lists, it has no lookup)."""
        spec = self.group(group)
        for letter in await self.broker.dead_letters(spec.group, limit=MAX_DEAD_LETTERS):
            if letter.message_id == message_id:
                return letter
        raise errors.NotFound(f"not a dead letter of {spec.group}: {message_id[:80]!r}")

    async def replay(
        self,
        group: str,
        message_ids: Sequence[str] | None,
        *,
        actor: str,
        progress: Callable[[int, int], None] | None = None,
    ) -> DeadLetterReplay:
        """Replay ``message_ids`` (``None``: every dead letter, listed again page by page until none
        is left) to ``group`` only; audit each replayed one. ``progress(done, total)`` after each.

        The port lists dead letters (oldest first, at most :data:`MAX_DEAD_LETTERS` a call) and has
        no look-up by id: a named id among the listed ones is audited with its key and delivery
        count, one past them with its message id alone. When the broker fails part way, what was
        replayed is audited before the error is raised, and the error says how far it got."""
        spec = self.group(group)
        listed = await self.broker.dead_letters(spec.group, limit=MAX_DEAD_LETTERS)
        letters = {d.message_id: d for d in listed}
        every = message_ids is None
        ids = list(letters) if every else list(dict.fromkeys(message_ids or ()))
        more = every and len(listed) == MAX_DEAD_LETTERS
        done: list[str] = []
        missing: list[str] = []
        unaudited: list[str] = []  # replayed, their audit rows not written yet
        total = len(ids)
        failure: errors.RoomServiceError | None = None

        async def audit() -> None:
            entries = [_audit_entry(spec.group, m, letters.get(m)) for m in unaudited]
            try:
                await self.audit.record_audit(entries, action="consumer_replay", actor=actor)
            except errors.RoomServiceError as exc:  # replayed for good: say which, and that nothing records it
                shown = ", ".join(unaudited[:10]) + (" …" if len(unaudited) > 10 else "")
                raise AuditNotWritten(
                    f"{len(done)} dead letter(s) of {spec.group} were replayed, but the audit of the last "
                    f"{len(unaudited)} could not be written ({shown}): {exc.message}"
                ) from exc
            unaudited.clear()

        try:
            while True:
                for message_id in ids:
                    replayed = await self.broker.replay_dead_letter(spec.group, message_id)
                    (done if replayed else missing).append(message_id)
                    if replayed:
                        unaudited.append(message_id)
                        if len(unaudited) >= AUDIT_CHUNK:  # a crash leaves at most a chunk unaudited
                            await audit()
                    if progress is not None:
                        progress(len(done) + len(missing), total)
                if not more:
                    break
                # --all past the first page: those replayed are no longer dead letters
                listed = await self.broker.dead_letters(spec.group, limit=MAX_DEAD_LETTERS)
                tried = {*done, *missing}
                ids = [d.message_id for d in listed if d.message_id not in tried]
                letters.update((d.message_id, d) for d in listed)
                total += len(ids)
                more = bool(ids) and len(listed) == MAX_DEAD_LETTERS
        except AuditNotWritten:
            raise
        except errors.RoomServiceError as exc:
            failure = exc
        await audit()
        if failure is not None:
            if not failure.retryable:
                raise failure
            raise errors.Unavailable(
                f"replay stopped after {len(done)} of {total} dead letter(s) of {spec.group} (those were "
                f"replayed and audited): {failure.message}"
            ) from failure
        return DeadLetterReplay(spec.group, tuple(done), tuple(missing))


def _audit_entry(group: str, message_id: str, letter: DeadLetter | None) -> tuple[str, dict[str, Any]]:
    """The audit row of one replayed dead letter, under its key (the event id); a named one the listing
    did not reach (past :data:`MAX_DEAD_LETTERS`) under its message id, its key unknown here."""
    if letter is None or not letter.key:
        return message_id, {"group": group, "message_id": message_id, "key": None}
    return letter.key, {"group": group, "message_id": message_id, "delivery_count": letter.delivery_count}


def describe(letter: DeadLetter) -> dict[str, Any]:
    """``letter`` in full for an operator: the broker's record and its body decoded.

    ``last_error`` is the reason the port keeps (the last failed delivery's error, or
    why it was buried). A body that does not decode (the poison message itself, often)
    is shown as ``undecodable`` with the decoder's error and the body's size."""
    out: dict[str, Any] = {
        "group": letter.group,
        "topic": letter.topic,
        "message_id": letter.message_id,
        "key": letter.key,
        "tag": letter.tag,
        "delivery_count": letter.delivery_count,
        "dead_at_ms": letter.dead_at_ms,
        "last_error": letter.reason,
        "headers": dict(letter.headers),
        "body_size": len(letter.body),
    }
    try:
        if letter.tag == WAKEUP_TAG:
            out["wakeup"] = asdict(TreasureWakeup.decode(letter.body))
        else:
            out["event"] = decode_event(letter.body).to_dict()
    except Exception as exc:  # any bytes at all: protobuf, KeyError for an unknown type, ValueError
        out["undecodable"] = f"{type(exc).__name__}: {exc}"[:300]
    return out
