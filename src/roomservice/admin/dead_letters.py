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

from collections.abc import Sequence
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

    async def replay(self, group: str, message_ids: Sequence[str] | None, *, actor: str) -> DeadLetterReplay:
        """Replay ``message_ids`` (``None``: every dead letter) to ``group`` only; audit each replayed one."""
        spec = self.group(group)
        letters = {d.message_id: d for d in await self.broker.dead_letters(spec.group, limit=MAX_DEAD_LETTERS)}
        ids = list(letters) if message_ids is None else list(dict.fromkeys(message_ids))
        done: list[str] = []
        missing: list[str] = []
        for message_id in ids:
            (done if await self.broker.replay_dead_letter(spec.group, message_id) else missing).append(message_id)
        await self.audit.record_audit(
            [
                (letters[m].key, {"group": spec.group, "message_id": m, "delivery_count": letters[m].delivery_count})
                for m in done
                if m in letters and letters[m].key
            ],
            action="consumer_replay",
            actor=actor,
        )
        return DeadLetterReplay(spec.group, tuple(done), tuple(missing))


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
