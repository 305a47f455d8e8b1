"""The write command pipeline of SPEC §2, and the room reads.

    idempotency -> lease + Room Cell -> decide on the current state -> wallet debit (gifts)
    -> SaveMutation -> apply -> snapshot -> projections -> IM group (CreateRoom) -> respond

With the embedded wallet (``commit_wallet``) a gift's debit is a write of its own
SaveMutation transaction instead of a call before it: it commits with the command or
not at all, so it is neither journaled nor preceded by a command log lookup.

Every command, success or failure, logs one ``room_command_timing`` line.
Nothing external is awaited between deciding and committing except the wallet,
and nothing after the commit can fail the command.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import orjson

from roomservice import errors
from roomservice.cell.cell import RoomCell
from roomservice.cell.registry import CellRegistry
from roomservice.clock import wall_clock_ms
from roomservice.domain import commands as c
from roomservice.domain import events as e
from roomservice.domain.decider import decide, replay, stamp
from roomservice.domain.routing import Target, touches
from roomservice.domain.rules import RoomRules
from roomservice.domain.state import CLOSED, RoomState
from roomservice.domain.view import room_view
from roomservice.leases.port import LeaseUnavailable
from roomservice.observability import tracing
from roomservice.observability.logging import get_logger, log_context
from roomservice.observability.timing import CommandTiming, Stopwatch, rounded_ms
from roomservice.projections.port import Projections
from roomservice.store.port import (
    Answer,
    AttachedWrite,
    CommandIdTaken,
    LoggedCommand,
    Mutation,
    RoomStore,
    StoreConflict,
    StoreUnavailable,
)
from roomservice.wallet.journal import DebitJournal, JournalEntry, SettleInCommit
from roomservice.wallet.port import (
    CommitWallet,
    DebitKeyConflict,
    InsufficientFunds,
    Wallet,
    WalletUnavailable,
    debit_key,
)

_log = get_logger("roomservice.service")


def fingerprint(command: c.Command, fields: dict[str, Any] | None = None) -> str:
    """sha256 of the command's canonical JSON: sorted keys, no spaces, ASCII (non-ASCII as \\u escapes).

    ``fields`` is ``command.to_dict()`` when the caller has it already. orjson
    writes the same bytes as ``json.dumps(sort_keys=True, separators=(",", ":"))``
    for printable ASCII without escapes (every id, most titles), ~5x faster;
    anything else takes the stdlib encoder, so stored fingerprints never change.
    """
    value = command.to_dict() if fields is None else fields
    canonical = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    if not _PLAIN_ASCII.fullmatch(canonical):
        canonical = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()


_PLAIN_ASCII = re.compile(rb"[\x20-\x5b\x5d-\x7e]*")  # printable ASCII without a backslash


def stored_timing(timing: CommandTiming) -> dict[str, float | bool]:
    """The ``room_command_timing`` figures known when the command log row is written, stored with it
    (the console's room inspector); the stages after the commit are in the log line only."""
    return {
        "idempotency_ms": rounded_ms(timing.idempotency_ms),
        "lease_ms": rounded_ms(timing.lease_ms),
        "wallet_debit_ms": rounded_ms(timing.wallet_debit_ms),
        "activity_ms": rounded_ms(timing.activity_ms),
        "activity_async_outbox": timing.activity_async_outbox,
        "tencent_im_async_outbox": timing.tencent_im_async_outbox,
    }


def answer_body(state: RoomState, events: list[e.Event], *, now_ms: int, level_count: int) -> Answer:
    """A command's answer: the room after it, its version and events, encoded once (:class:`Answer`)."""
    return Answer({
        "room": room_view(state, now_ms=now_ms, level_count=level_count),
        "version": state.version,
        "events": [{"event_id": ev.event_id, "type": ev.type} for ev in events],
        "replayed": False,
    })


class GroupProvisioner(Protocol):
    """Creates a room's IM group synchronously on CreateRoom (best effort, timed)."""

    async def ensure_group(self, *, app_code: str, room_id: str, owner_id: str, title: str) -> None: ...


@dataclass(slots=True)
class ServiceOptions:
    snapshot_every_n: int = 50
    wallet_timeout_s: float = 2.0
    im_timeout_s: float = 3.0
    room_list_limit: int = 100


UNPROJECTED_MAX: Final = 10_000


@dataclass(slots=True)
class RoomService:
    store: RoomStore
    registry: CellRegistry
    rules: RoomRules
    wallet: Wallet
    journal: DebitJournal
    projections: Projections
    options: ServiceOptions = field(default_factory=ServiceOptions)
    groups: GroupProvisioner | None = None
    clock: Callable[[], int] = wall_clock_ms
    new_event_id: Callable[[], str] = e.new_event_id
    # called after every commit that wrote outbox rows (wakes the local outbox worker)
    on_outbox_commit: list[Callable[[], None]] = field(default_factory=list)
    # ``wallet`` again when its ledger is in the store's database: debits go into the commit
    commit_wallet: CommitWallet | None = None
    # rooms whose latest committed state the projections failed to take (Redis away): written again by
    # repair_projections, since nothing else would for a closed or quiet room
    unprojected: dict[tuple[str, str], RoomState] = field(default_factory=dict)

    # ------------------------------------------------------------------ writes

    async def execute(self, app_code: str, room_id: str, command_id: str, command: c.Command) -> dict[str, Any]:
        """Run one write command; returns the response body or raises RoomServiceError."""
        timing = CommandTiming(command=command.name, app_code=app_code, room_id=room_id, command_id=command_id)
        total = Stopwatch()
        # every line logged while this command runs names it (structlog merges contextvars)
        with log_context(app_code=app_code, room_id=room_id, command_id=command_id):
            if tracing.ENABLED:  # the command's span, its stages drawn from `timing` afterwards
                return await tracing.traced_command(
                    timing, lambda: self._timed(app_code, room_id, command_id, command, timing, total)
                )
            return await self._timed(app_code, room_id, command_id, command, timing, total)

    async def _timed(
        self,
        app_code: str,
        room_id: str,
        command_id: str,
        command: c.Command,
        timing: CommandTiming,
        total: Stopwatch,
    ) -> dict[str, Any]:
        try:
            try:
                body = await self._execute(app_code, room_id, command_id, command, timing)
            except StoreUnavailable as exc:
                raise errors.Unavailable("database unavailable; retry with the same command_id") from exc
            timing.version = body["version"]
            return body
        except errors.RoomServiceError as exc:
            timing.result = exc.code
            raise
        except asyncio.CancelledError:
            timing.result = "cancelled"
            raise
        except Exception:
            timing.result = "internal"
            raise
        finally:
            timing.total_ms = total.elapsed_ms()
            timing.emit()

    async def _execute(
        self, app_code: str, room_id: str, command_id: str, command: c.Command, timing: CommandTiming
    ) -> dict[str, Any]:
        watch = Stopwatch()
        for _attempt in range(3):
            cell = await self._cell(app_code, room_id)
            timing.lease_ms += watch.lap()
            async with cell.turn():
                if cell.retired:  # evicted or fenced while we queued: take the fresh cell
                    continue
                try:
                    return await self._run_turn(cell, command_id, command, timing, watch)
                finally:  # (the turn's holder only: one still queued, a CreateRoom ahead of it, knows nothing yet)
                    if cell.state is None and not cell.retired:  # no such room: keep no cell for it
                        await self.registry.retire(cell)
        raise errors.Retry("room kept moving; retry")

    async def _run_turn(
        self, cell: RoomCell, command_id: str, command: c.Command, timing: CommandTiming, watch: Stopwatch
    ) -> dict[str, Any]:
        """One command on a held cell. Returns the response body."""
        app_code, room_id = cell.app_code, cell.room_id
        try:
            cell.lease = await self.registry.leases.ensure(cell.lease)
        except LeaseUnavailable as exc:
            await self.registry.retire(cell, lost="ensure")
            raise errors.Retry(str(exc)) from exc
        timing.lease_ms += watch.lap()

        command_fields = command.to_dict()
        print_ = fingerprint(command, command_fields)
        # Idempotency: the command log's unique (room, command_id) key is the authority.
        # Recent ids are answered from the cell; a gift whose wallet debit goes out before
        # the commit (an external wallet), and must not for a reused id, is looked up
        # before anything else; any other command (a gift with its debit in the commit
        # too) finds out at commit (CommandIdTaken) or when the current state rejects it.
        logged = cell.remembered(command_id)
        if logged is None and isinstance(command, c.SendGift) and self.commit_wallet is None:
            logged = await self.store.find_command(app_code, room_id, command_id)
        timing.idempotency_ms = watch.lap()
        if logged is not None:
            return self._replay(logged, print_, timing)

        before = cell.state
        now_ms = self.clock()
        try:
            payloads = decide(before, command, now_ms=now_ms, rules=self.rules)
        except errors.DomainError:
            # a retry of a committed command may be invalid on today's state: answer the original
            logged = await self.store.find_command(app_code, room_id, command_id)
            timing.idempotency_ms += watch.lap()
            if logged is not None:
                return self._replay(logged, print_, timing)
            raise
        events = stamp(
            payloads, state=before, app_code=app_code, room_id=room_id, now_ms=now_ms, new_event_id=self.new_event_id
        )
        after = replay(before, events) if events else before
        assert after is not None  # decide raised room_not_found otherwise
        types = [ev.type for ev in events]
        timing.activity_async_outbox = touches(types, Target.ACTIVITY)
        timing.tencent_im_async_outbox = touches(types, Target.IM)

        gift = next((p for p in payloads if isinstance(p, e.RoomGiftSent)), None)
        attached: AttachedWrite | None = None
        if gift is not None:
            watch.lap()
            if self.commit_wallet is None:
                await self._debit(app_code, room_id, command_id, gift, now_ms)
                attached = SettleInCommit(debit_key(app_code, room_id, command_id))  # the journal entry goes
            else:  # written by save_mutation; this is its preparation only
                attached = await self.commit_wallet.debit_in_commit(
                    key=debit_key(app_code, room_id, command_id),
                    app_code=app_code,
                    user_id=gift.sender_id,
                    amount=gift.total_value,
                )
            timing.wallet_debit_ms = watch.lap()

        body = answer_body(after, events, now_ms=now_ms, level_count=len(self.rules.treasure_levels))
        mutation = Mutation(
            app_code=app_code,
            room_id=room_id,
            command_id=command_id,
            command_type=command.name,
            fingerprint=print_,
            command=command_fields,
            events=tuple(events),
            response=body,
            now_ms=now_ms,
            expected_version=0 if before is None else before.version,
            epoch=cell.epoch,
            state_after=after,
            trace_context=tracing.current_traceparent(),  # stored with the outbox rows
            timing=stored_timing(timing),
            attached=attached,
        )
        watch.lap()
        try:
            await self.store.save_mutation(mutation)
        except CommandIdTaken:
            # already committed (a retry, or a race with another writer): answer the original
            replayed = await self._committed_answer(cell, command_id, print_, timing)
            if replayed is None:
                raise errors.Retry("command_id race; retry") from None
            return replayed
        except (InsufficientFunds, DebitKeyConflict) as exc:
            # the debit in the commit was refused, nothing written; a retry of a committed
            # gift (not looked up first) answers as it did then, whatever the balance now
            replayed = await self._committed_answer(cell, command_id, print_, timing)
            if replayed is None:
                raise _refusal(exc) from exc
            return replayed
        except StoreUnavailable as exc:
            # the commit may or may not have happened: never trust this cell's state again
            await self.registry.retire(cell)
            raise errors.Unavailable("database unavailable; retry with the same command_id") from exc
        except StoreConflict as exc:
            await self.registry.retire(cell, lost="fenced")
            raise errors.Retry("lost the room's lease or version race; retry") from exc
        except BaseException:
            # cancelled (the client went away) or failed mid-commit: the mutation may still
            # commit, so this cell's state can no longer be trusted either
            self.registry.discard(cell)
            raise
        timing.save_mutation_ms = watch.lap()
        cell.commit(after, LoggedCommand(command_id, print_, body, body["version"]))
        if not events:
            return body

        for wake in self.on_outbox_commit:
            wake()
        closed_now = after.status == CLOSED and (before is None or before.status != CLOSED)
        if after.version % self.options.snapshot_every_n == 0 or closed_now:
            # (a closed room takes no more commands: without its last snapshot its log tail, which
            # recovery would need, could never be pruned, and every prune pass scanned it again)
            await self._snapshot(after, now_ms)
            timing.snapshot_ms = watch.lap()
        await self._project(before, after)
        timing.projection_ms = watch.lap()
        if isinstance(command, c.CreateRoom):
            await self._create_group(app_code, room_id, after)
            timing.tencent_im_ms = watch.lap()
        return body

    async def _cell(self, app_code: str, room_id: str) -> RoomCell:
        try:
            return await self.registry.cell(app_code, room_id)
        except LeaseUnavailable as exc:
            raise errors.Retry(str(exc)) from exc

    async def _committed_answer(
        self, cell: RoomCell, command_id: str, print_: str, timing: CommandTiming
    ) -> dict[str, Any] | None:
        """The answer of ``command_id`` as the command log has it (remembered by the cell), or None."""
        logged = await self.store.find_command(cell.app_code, cell.room_id, command_id)
        if logged is None:
            return None
        cell.remember(logged)
        return self._replay(logged, print_, timing)

    @staticmethod
    def _replay(logged: LoggedCommand, print_: str, timing: CommandTiming) -> dict[str, Any]:
        if logged.fingerprint != print_:
            raise errors.CommandIdReused()
        timing.replayed = True
        return {**logged.response, "replayed": True}

    async def _debit(self, app_code: str, room_id: str, command_id: str, gift: e.RoomGiftSent, now_ms: int) -> None:
        key = debit_key(app_code, room_id, command_id)
        entry = JournalEntry(key, app_code, room_id, command_id, gift.sender_id, gift.total_value, now_ms)
        try:
            async with asyncio.timeout(self.options.wallet_timeout_s):
                journaled_before = await self.journal.record(entry)
                debit = await self.wallet.debit(
                    key=key, app_code=app_code, user_id=gift.sender_id, amount=gift.total_value
                )
            if not debit.charged and not journaled_before:
                # The key's debit is no attempt of this command's (that would be journaled): a gift
                # committed under this command_id, its log row since pruned (room.idempotency_retention).
                # Never a gift for free; and this attempt's entry goes, or reconciliation would refund
                # the earlier gift's debit.
                await self.journal.forget(key)
                raise DebitKeyConflict(key, reused=True)
        except InsufficientFunds as exc:
            await self.journal.forget(key)
            raise _refusal(exc) from exc
        except DebitKeyConflict as exc:
            raise _refusal(exc) from exc
        except (WalletUnavailable, TimeoutError) as exc:
            _log.warning("wallet_unavailable", debit_key=key, error=repr(exc))
            raise errors.Unavailable("wallet unavailable; retry with the same command_id") from exc

    async def _snapshot(self, state: RoomState, now_ms: int) -> None:
        try:
            await self.store.save_snapshot(state, now_ms=now_ms)
        except Exception:  # recovery still works from an older snapshot plus the log
            _log.exception("snapshot_failed", app_code=state.app_code, room_id=state.room_id, version=state.version)

    async def _project(self, before: RoomState | None, after: RoomState) -> None:
        try:
            await self.projections.room_changed(before, after)
        except Exception as exc:
            _log.warning("projection_failed", app_code=after.app_code, room_id=after.room_id, error=repr(exc))
            key = (after.app_code, after.room_id)
            self.unprojected.pop(key, None)
            self.unprojected[key] = after  # the newest state, last in order
            while len(self.unprojected) > UNPROJECTED_MAX:  # bounded: the oldest go (a rebuild remains)
                del self.unprojected[next(iter(self.unprojected))]
        else:
            if self.unprojected:  # (empty but after an outage: nothing to look up on the command path)
                self.unprojected.pop((after.app_code, after.room_id), None)  # a newer state went through

    async def repair_projections(self) -> int:
        """Write again, in full, each room state the projections failed to take; how many went through.
        A state older than what the projection holds by now is refused there as stale (versions)."""
        repaired = 0
        for key, state in list(self.unprojected.items()):
            try:
                await self.projections.room_changed(None, state)  # no "before": the whole room, members too
            except Exception as exc:
                _log.warning("projection_repair_failed", app_code=key[0], room_id=key[1], error=repr(exc))
                if isinstance(exc, errors.Unavailable):
                    break  # still away: the next round tries again
                if self.unprojected.get(key) is state:  # this room alone: last in line, the others go on
                    del self.unprojected[key]
                    self.unprojected[key] = state
                continue
            if self.unprojected.get(key) is state:
                del self.unprojected[key]
            repaired += 1
        if repaired:
            _log.info("projections_repaired", rooms=repaired, left=len(self.unprojected))
        return repaired

    async def run_projection_repair(self, *, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if self.unprojected:
                await self.repair_projections()

    async def _create_group(self, app_code: str, room_id: str, state: RoomState) -> None:
        if self.groups is None:
            return
        try:
            async with asyncio.timeout(self.options.im_timeout_s):
                await self.groups.ensure_group(
                    app_code=app_code, room_id=room_id, owner_id=state.owner_id, title=state.title
                )
        except Exception as exc:  # RoomCreated's outbox row retries EnsureGroup
            _log.warning("im_group_create_failed", app_code=app_code, room_id=room_id, error=repr(exc))

    # ------------------------------------------------------------------ reads

    async def room(self, app_code: str, room_id: str) -> dict[str, Any]:
        cell = self.registry.peek(app_code, room_id)
        if cell is not None:
            state = cell.state
        else:
            try:
                state = (await self.store.load_room(app_code, room_id)).state
            except StoreUnavailable as exc:
                raise errors.Unavailable("database unavailable") from exc
        if state is None:
            raise errors.RoomNotFound()
        return room_view(state, now_ms=self.clock(), level_count=len(self.rules.treasure_levels))

    async def rooms(self, app_code: str, *, limit: int | None = None) -> list[dict[str, object]]:
        entries = await self.projections.list_rooms(app_code, limit=limit or self.options.room_list_limit)
        return [entry.to_dict() for entry in entries]

    async def presence(self, app_code: str, user_id: str) -> dict[str, object]:
        """Which room the user is in, as the presence projection has it (``room_id`` None: none)."""
        room_id = await self.projections.room_of(app_code, user_id)
        return {"app_code": app_code, "user_id": user_id, "room_id": room_id}

    def gifts(self) -> list[dict[str, object]]:
        return [{"id": g.id, "name": g.name, "price": g.price} for g in self.rules.gifts.values()]


def _refusal(exc: InsufficientFunds | DebitKeyConflict) -> errors.RoomServiceError:
    """The answer to a debit the wallet refused (nothing was debited)."""
    if isinstance(exc, InsufficientFunds):
        return errors.InsufficientBalance()
    if exc.reused:
        return errors.CommandIdReused("command_id was already used for a gift that committed earlier; use a new one")
    return errors.CommandIdReused("command_id was already used for a different gift")
