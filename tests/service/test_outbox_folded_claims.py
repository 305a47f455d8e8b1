"""The worker's next claim rides on its previous finish (``finish_and_claim``): a property test
that, whatever the interleaving of two workers, publish failures and database failures around
the folded transaction, no row is held by two workers, no row is delivered twice and no
finish is lost (every row ends delivered, none stays claimed)."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.service.conftest import T0, Clock

from roomservice.domain import events as e
from roomservice.domain.events import Event
from roomservice.outbox.model import PublishMode
from roomservice.outbox.policy import RetryPolicy
from roomservice.outbox.sql import SqlOutboxRepository
from roomservice.outbox.worker import OutboxWorker, WorkerOptions
from roomservice.publishers.port import PublisherSet, RetryableError
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.store.migrate import upgrade
from roomservice.store.port import StoreUnavailable
from roomservice.wire import encode_event

BATCH = 3


class CountingPublisher:
    """Succeeds unless told to fail the next few publishes; counts each successful publish."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.fail_next = 0
        self.successes: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()

    async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
        if self.fail_next:
            self.fail_next -= 1
            self.failures[event.event_id] += 1
            raise RetryableError(f"{self.name} failed transiently")
        self.successes[event.event_id] += 1


class FailingAroundCommit:
    """The real repository; ``finish_and_claim`` may fail before its transaction (nothing
    written) or after its COMMIT (written, the answer lost), as a deadline can."""

    def __init__(self, inner: SqlOutboxRepository) -> None:
        self.inner = inner
        self.fail: str | None = None  # "before" | "after"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def finish_and_claim(self, **kwargs: Any) -> tuple[int, list[Any]]:
        fail, self.fail = self.fail, None
        if fail == "before":
            raise StoreUnavailable("database call exceeded its deadline")
        answer = await self.inner.finish_and_claim(**kwargs)
        if fail == "after":
            raise StoreUnavailable("database call exceeded its deadline")
        return answer


async def _insert(db: Database, events: list[Event], now_ms: int) -> None:
    async with db.write() as conn:
        await conn.execute(
            sa.insert(t.room_outbox),
            [
                dict(
                    event_id=ev.event_id,
                    app_code="demo",
                    room_id=ev.room_id,
                    room_version=1,
                    event_type=ev.type,
                    payload=encode_event(ev),
                    status="pending",
                    retry_count=0,
                    targets_done="",
                    due_at_ms=now_ms,
                    created_at_ms=now_ms,
                    updated_at_ms=now_ms,
                )
                for ev in events
            ],
        )


def _events(n: int) -> list[Event]:
    return [Event(uuid.uuid4().hex, "demo", f"r{i}", 1, T0, e.RoomMicLeft(user_id="u", seat=1)) for i in range(n)]


steps = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(1, 5)),
        st.tuples(st.just("cycle"), st.integers(0, 1)),
        st.tuples(st.just("publish_fails"), st.integers(1, 3)),
        st.tuples(st.just("finish_fails"), st.integers(0, 1), st.sampled_from(["before", "after"])),
        st.tuples(st.just("advance"), st.integers(500, 2_500)),
    ),
    min_size=1,
    max_size=30,
)


async def _scenario(script: list[tuple[Any, ...]], path: Path) -> None:
    db = Database.from_url(f"sqlite+aiosqlite:///{path}")
    try:
        await upgrade(db)
        clock = Clock()
        publisher = CountingPublisher("im")
        repositories = [FailingAroundCommit(SqlOutboxRepository(db)) for _ in range(2)]
        workers = [
            OutboxWorker(
                repository=repo,  # type: ignore[arg-type]
                publishers=PublisherSet({"im": publisher}),
                policy=RetryPolicy(initial_backoff_ms=1_000, max_backoff_ms=2_000, max_retry_count=100, jitter=0),
                options=WorkerOptions(mode=PublishMode.DIRECT, batch_size=BATCH, lock_timeout_s=600),
                clock=clock,
                owner=f"w{n}",
            )
            for n, repo in enumerate(repositories)
        ]
        events: list[str] = []

        async def check_claims() -> None:
            """Rows a worker carries into its next cycle are claimed by it, and by it alone."""
            async with db.read() as conn:
                owners = dict((await conn.execute(sa.select(t.room_outbox.c.id, t.room_outbox.c.lock_owner))).all())
            for worker in workers:
                for carried in worker._carried or []:
                    assert owners[carried.id] == worker.owner

        async def cycle(worker: OutboxWorker) -> None:
            with contextlib.suppress(StoreUnavailable):  # the loop backs off; the next cycle writes
                await worker.run_once()  # the finish and hands the claims back
            await check_claims()

        for step in script:
            if step[0] == "insert":
                batch = [
                    Event(
                        uuid.uuid4().hex, "demo", f"r{len(events) + i}", 1, clock(), e.RoomMicLeft(user_id="u", seat=1)
                    )
                    for i in range(step[1])
                ]
                events.extend(ev.event_id for ev in batch)
                await _insert(db, batch, clock())
            elif step[0] == "cycle":
                await cycle(workers[step[1]])
            elif step[0] == "publish_fails":
                publisher.fail_next = step[1]
            elif step[0] == "finish_fails":
                repositories[step[1]].fail = step[2]
            else:
                clock.advance(step[1])

        # drain: no more failures, time moves on past any backoff
        publisher.fail_next = 0
        for repo in repositories:
            repo.fail = None
        for _ in range(4 * len(events) + 8):
            clock.advance(2_500)
            for worker in workers:
                await cycle(worker)
        async with db.read() as conn:
            statuses = dict((await conn.execute(sa.select(t.room_outbox.c.event_id, t.room_outbox.c.status))).all())
            retries = dict(
                (await conn.execute(sa.select(t.room_outbox.c.event_id, t.room_outbox.c.retry_count))).all()
            )
        assert statuses == dict.fromkeys(events, "delivered")  # no finish lost, nothing left claimed
        assert publisher.successes == Counter(dict.fromkeys(events, 1))  # none delivered twice
        # each failed attempt counted once: a finish written again (its answer lost) counts nothing twice
        assert {ev: retries[ev] for ev in events} == {ev: publisher.failures[ev] for ev in events}
    finally:
        await db.dispose()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=steps)
def test_folded_claims_never_double_deliver_or_lose_a_finish(script: list[tuple[Any, ...]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_scenario(script, Path(tmp) / "outbox.db"))


def _run(scenario: Callable[[Database], Awaitable[None]]) -> None:
    """``scenario`` on a new, migrated SQLite database."""

    async def main(path: Path) -> None:
        db = Database.from_url(f"sqlite+aiosqlite:///{path}")
        try:
            await upgrade(db)
            await scenario(db)
        finally:
            await db.dispose()

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(Path(tmp) / "outbox.db"))


def _worker(repository: Any, publisher: CountingPublisher, **options: Any) -> OutboxWorker:
    return OutboxWorker(
        repository=repository,
        publishers=PublisherSet({"im": publisher}),
        policy=RetryPolicy(initial_backoff_ms=1_000, max_backoff_ms=2_000, max_retry_count=3, jitter=0),
        options=WorkerOptions(mode=PublishMode.DIRECT, batch_size=BATCH, **options),
        clock=Clock(T0),
    )


async def _statuses(db: Database) -> dict[str, str]:
    async with db.read() as conn:
        return dict((await conn.execute(sa.select(t.room_outbox.c.event_id, t.room_outbox.c.status))).all())


def test_a_folded_claim_carries_the_next_batch_in_the_finish_transaction() -> None:
    """Under load a batch costs one write transaction: claim, then finish + claim, ..."""

    async def scenario(db: Database) -> None:
        repo = SqlOutboxRepository(db)
        calls: Counter[str] = Counter()
        for name in ("claim_due", "finish", "finish_and_claim"):
            method = getattr(repo, name)

            async def counted(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
                calls[_name] += 1
                return await _method(*args, **kwargs)

            setattr(repo, name, counted)
        publisher = CountingPublisher("im")
        worker = _worker(repo, publisher)
        batch = _events(10)
        await _insert(db, batch, T0)
        taken = [await worker.run_once() for _ in range(5)]
        assert taken == [3, 3, 3, 1, 0]
        # one claim alone; while a full batch publishes, the next is claimed with the last
        # batch's finish (the first such claim carries no finish); the fourth, short batch is
        # finished after its publishes together with the third's, claiming none; the fifth
        # cycle claimed alone and found nothing
        assert calls == Counter({"claim_due": 2, "finish_and_claim": 4})
        assert publisher.successes == Counter({ev.event_id: 1 for ev in batch})

    _run(scenario)


class ClaimWatchingPublisher(CountingPublisher):
    """Its first publish of each batch waits (up to 2 s) for the worker's next claim to begin."""

    def __init__(self, name: str, claim_began: asyncio.Event) -> None:
        super().__init__(name)
        self.claim_began = claim_began
        self.saw_claim: list[bool] = []

    async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.claim_began.wait(), 2.0)
        self.saw_claim.append(self.claim_began.is_set())
        await super().publish(event, payload=payload, deadline=deadline)


def test_under_a_backlog_the_next_batch_is_claimed_while_this_one_publishes() -> None:
    """A full batch's publishes and the database overlap: the next batch is claimed (with the last
    batch's finish) while this one publishes; that finish is written by the next claim."""

    async def scenario(db: Database) -> None:
        repo = SqlOutboxRepository(db)
        claim_began = asyncio.Event()
        inner = repo.finish_and_claim

        async def watched(**kwargs: Any) -> Any:
            claim_began.set()
            return await inner(**kwargs)

        repo.finish_and_claim = watched  # type: ignore[method-assign]
        publisher = ClaimWatchingPublisher("im", claim_began)
        worker = _worker(repo, publisher)
        events = _events(2 * BATCH + 1)
        await _insert(db, events, T0)
        assert await worker.run_once() == BATCH
        assert publisher.saw_claim == [True] * BATCH  # claimed while the first batch published
        carried = worker._carried or []
        assert [r.event_id for r in carried] == [ev.event_id for ev in events[BATCH : 2 * BATCH]]
        statuses = await _statuses(db)
        # the first batch's finish is held for the next claim: published, not yet marked
        assert [statuses[ev.event_id] for ev in events[:BATCH]] == ["delivering"] * BATCH
        assert statuses[events[-1].event_id] == "pending"

        claim_began.clear()
        assert await worker.run_once() == BATCH
        assert publisher.saw_claim == [True] * (2 * BATCH)
        statuses = await _statuses(db)
        assert [statuses[ev.event_id] for ev in events[:BATCH]] == ["delivered"] * BATCH
        assert statuses[events[-1].event_id] == "delivering"  # claimed ahead, carried

        claim_began.clear()
        assert await worker.run_once() == 1  # a short batch: no claim ahead, finished after it
        assert publisher.saw_claim[-1] is False
        assert await _statuses(db) == dict.fromkeys((ev.event_id for ev in events), "delivered")
        assert publisher.successes == Counter({ev.event_id: 1 for ev in events})

    _run(scenario)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_claim_ahead_that_fails_loses_no_finish_and_delivers_nothing_twice(when: str) -> None:
    """The transaction that writes the last batch's finish and claims the next fails while a batch
    publishes — before its COMMIT or after it with the answer lost: the next cycle writes both
    batches' finishes, hands back whatever that transaction may have claimed, and goes on."""

    async def scenario(db: Database) -> None:
        repo = FailingAroundCommit(SqlOutboxRepository(db))
        publisher = CountingPublisher("im")
        worker = _worker(repo, publisher)
        events = _events(3 * BATCH)
        await _insert(db, events, T0)
        assert await worker.run_once() == BATCH  # the second batch claimed ahead
        repo.fail = when  # the third is claimed (with the first's finish) while the second publishes
        with pytest.raises(StoreUnavailable):
            await worker.run_once()
        assert worker._carried is None
        statuses = await _statuses(db)
        first, second, third = events[:BATCH], events[BATCH : 2 * BATCH], events[2 * BATCH :]
        assert {statuses[ev.event_id] for ev in first} == {"delivered" if when == "after" else "delivering"}
        assert {statuses[ev.event_id] for ev in second} == {"delivering"}  # published, finish unwritten
        assert {statuses[ev.event_id] for ev in third} == {"delivering" if when == "after" else "pending"}
        for _ in range(3):
            await worker.run_once()
        assert await _statuses(db) == dict.fromkeys((ev.event_id for ev in events), "delivered")
        assert publisher.successes == Counter({ev.event_id: 1 for ev in events})  # none twice

    _run(scenario)


def test_shutdown_writes_a_held_finish_and_hands_the_rows_claimed_ahead_back() -> None:
    """Stopped mid-backlog, with a batch publishing and the next one claimed ahead: the published
    rows end delivered (the held finish is written), the rest go back to pending, none stays claimed."""

    async def scenario(db: Database) -> None:
        gate, reached = asyncio.Event(), asyncio.Event()

        class GatedPublisher(CountingPublisher):
            async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
                if sum(self.successes.values()) == BATCH + 1:  # in the second batch
                    reached.set()
                    await gate.wait()
                await super().publish(event, payload=payload, deadline=deadline)

        publisher = GatedPublisher("im")
        worker = _worker(SqlOutboxRepository(db), publisher, publish_timeout_s=30)
        events = _events(4 * BATCH)
        await _insert(db, events, T0)
        worker.start()
        await asyncio.wait_for(reached.wait(), 10)
        stopping = asyncio.create_task(worker.shutdown(grace_s=10))
        await asyncio.sleep(0)
        gate.set()
        await asyncio.wait_for(stopping, 15)
        statuses = await _statuses(db)
        published = set(publisher.successes)
        assert len(published) == 2 * BATCH  # the second batch ended; nothing claimed ahead was sent
        assert {statuses[i] for i in published} == {"delivered"}
        assert {s for i, s in statuses.items() if i not in published} == {"pending"}
        assert publisher.successes == Counter(dict.fromkeys(published, 1))

    _run(scenario)


def test_a_held_finish_keeps_its_rows_claimed_while_a_short_batch_publishes_slowly() -> None:
    """A full batch's finish is held for the claim after it; when that claim brings a short batch,
    the finish is written only after the short batch publishes. Meanwhile the held rows stay this
    worker's: the lease keeper extends them with the batch in flight, so another worker cannot take
    (and publish again) rows that were delivered."""

    async def scenario(db: Database) -> None:
        gate, reached = asyncio.Event(), asyncio.Event()

        class SlowLast(CountingPublisher):
            async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
                if sum(self.successes.values()) == BATCH:  # the short batch after a full one
                    reached.set()
                    await gate.wait()
                await super().publish(event, payload=payload, deadline=deadline)

        publisher = SlowLast("im")
        worker = _worker(SqlOutboxRepository(db), publisher, lock_timeout_s=0.3, publish_timeout_s=30)
        clock = cast(Clock, worker.clock)
        events = _events(BATCH + 1)
        await _insert(db, events, T0)
        assert await worker.run_once() == BATCH  # its finish held, the last row claimed ahead
        short = asyncio.create_task(worker.run_once())
        await asyncio.wait_for(reached.wait(), 10)
        clock.advance(10_000)  # far past the held rows' lease (300 ms)
        other = SqlOutboxRepository(db)
        deadline = asyncio.get_running_loop().time() + 10
        while True:  # the keeper extends every 0.1 s: wait for it to have run at the new time
            async with db.read() as conn:
                until = (
                    await conn.execute(
                        sa.select(sa.func.min(t.room_outbox.c.lock_until_ms)).where(
                            t.room_outbox.c.status == "delivering"
                        )
                    )
                ).scalar_one()
            if until is not None and until > clock.now_ms:
                break
            assert asyncio.get_running_loop().time() < deadline, "the held rows were never extended"
            await asyncio.sleep(0.02)
        taken = await other.claim_due(owner="other", now_ms=clock.now_ms, lock_ms=30_000, limit=10)
        assert taken == []  # nothing of this worker's could be taken over
        gate.set()
        assert await short == 1
        statuses = await _statuses(db)
        assert statuses == dict.fromkeys((ev.event_id for ev in events), "delivered")
        assert publisher.successes == Counter({ev.event_id: 1 for ev in events})

    _run(scenario)


def test_a_merged_finish_written_again_counts_a_failure_once() -> None:
    """A full batch's decisions are held and written with the next, short batch's; by then the held
    retry may be due. The transaction that writes them must not claim that row again: written and its
    answer lost, the finish is written again next cycle, and a row claimed again by this owner
    matches its guard (retry_count counted twice, a dead letter early)."""

    async def scenario(db: Database) -> None:
        publisher = CountingPublisher("im")
        repo = FailingAroundCommit(SqlOutboxRepository(db))
        worker = _worker(repo, publisher)
        clock = cast(Clock, worker.clock)
        events = _events(BATCH + 1)
        await _insert(db, events, T0)
        publisher.fail_next = 1  # the first row's one failure
        assert await worker.run_once() == BATCH  # its retry decided and held; the last row claimed ahead
        clock.advance(2_000)  # past the retry's 1 s backoff
        repo.fail = "after"  # the merged finish (+ claim) commits, its answer lost
        with contextlib.suppress(StoreUnavailable):
            await worker.run_once()
        await worker.run_once()  # writes it again, hands back what it held
        for _ in range(3):
            clock.advance(2_000)
            await worker.run_once()
        async with db.read() as conn:
            row = (
                await conn.execute(
                    sa.select(t.room_outbox.c.retry_count, t.room_outbox.c.status).where(
                        t.room_outbox.c.event_id == events[0].event_id
                    )
                )
            ).one()
        assert tuple(row) == (1, "delivered")
        assert publisher.failures[events[0].event_id] == 1

    _run(scenario)


def test_a_held_finish_whose_claim_ahead_failed_stays_claimed_while_the_batch_publishes() -> None:
    """The claim ahead that was to write the last batch's finish fails while this batch publishes
    (a long time): the last batch's rows, published and their finish unwritten, are extended with
    this batch's, so no other worker takes them over and publishes them again."""

    async def scenario(db: Database) -> None:
        gate, reached = asyncio.Event(), asyncio.Event()

        class Slow(CountingPublisher):
            async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
                if sum(self.successes.values()) == BATCH:  # the second batch's first row: hangs a while
                    reached.set()
                    await gate.wait()
                await super().publish(event, payload=payload, deadline=deadline)

        publisher = Slow("im")
        repo = FailingAroundCommit(SqlOutboxRepository(db))
        worker = _worker(repo, publisher, lock_timeout_s=0.3, publish_timeout_s=30)
        clock = cast(Clock, worker.clock)
        events = _events(3 * BATCH)
        await _insert(db, events, T0)
        assert await worker.run_once() == BATCH  # the first batch published, its finish held
        repo.fail = "before"  # the claim ahead (with the first batch's finish) fails
        second = asyncio.create_task(worker.run_once())
        await asyncio.wait_for(reached.wait(), 10)
        clock.advance(10_000)  # far past the first claim's lease

        async def extended() -> None:  # the keeper (every lock_timeout / 3) has run since
            assert worker.claims_extended >= 2

        for _ in range(200):
            with contextlib.suppress(AssertionError):
                await extended()
                break
            await asyncio.sleep(0.01)
        await extended()
        taken = await SqlOutboxRepository(db).claim_due(owner="other", now_ms=clock.now_ms, lock_ms=30_000, limit=10)
        gate.set()
        with contextlib.suppress(StoreUnavailable):
            await second
        first = {ev.event_id for ev in events[:BATCH]}
        assert not [r.event_id for r in taken if r.event_id in first]  # still ours: not published again

    _run(scenario)


def test_a_shutdown_past_its_grace_hands_back_only_the_rows_not_delivered() -> None:
    """A batch cancelled by a shutdown whose grace ran out: the rows it had delivered are written as
    delivered, not handed back with the rest and published again after a restart."""

    async def scenario(db: Database) -> None:
        gate = asyncio.Event()

        class OneRoomHangs(CountingPublisher):
            async def publish(self, event: Event, *, payload: bytes, deadline: float) -> None:
                if event.room_id == "r1":
                    await gate.wait()
                await super().publish(event, payload=payload, deadline=deadline)

        publisher = OneRoomHangs("im")
        worker = _worker(SqlOutboxRepository(db), publisher, publish_timeout_s=30)
        events = _events(2)  # r0 goes out at once, r1 hangs
        await _insert(db, events, T0)
        worker.start()
        for _ in range(500):
            if publisher.successes:
                break
            await asyncio.sleep(0.01)
        assert publisher.successes == Counter({events[0].event_id: 1})
        await worker.shutdown(grace_s=0.1)
        assert await _statuses(db) == {events[0].event_id: "delivered", events[1].event_id: "pending"}

        gate.set()
        restarted = _worker(SqlOutboxRepository(db), publisher)
        await restarted.run_once()
        assert publisher.successes == Counter(dict.fromkeys((ev.event_id for ev in events), 1))  # r0 once
        assert await _statuses(db) == dict.fromkeys((ev.event_id for ev in events), "delivered")

    _run(scenario)
