"""CommandMetrics: commands recorded and applied in batches export exactly what observing each
command on its own does, and nothing recorded is missing from a collect."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import Counter, Histogram

from roomservice.observability.metrics import STAGES, CommandMetrics, FlushingRegistry, HeldBack
from roomservice.observability.timing import CommandTiming

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(registry: FlushingRegistry) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for metric in registry.collect()
        for s in metric.samples
        if not s.name.endswith("_created")
    }


def _assert_same(got: Samples, want: Samples) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():  # counts exactly; sums up to the order of float additions
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), key


stage_ms = st.one_of(st.just(0.0), st.floats(min_value=0, max_value=5_000, allow_nan=False))
commands = st.lists(
    st.tuples(
        st.sampled_from(["JoinRoom", "SendGift", "CreateRoom"]),
        st.sampled_from(["ok", "not_member", "internal"]),
        st.lists(stage_ms, min_size=len(STAGES), max_size=len(STAGES)),
    ),
    max_size=40,
)


@given(commands, st.integers(min_value=1, max_value=10))
def test_batches_export_what_commands_observed_one_by_one_do(
    recorded: list[tuple[str, str, list[float]]], flush_every: int
) -> None:
    one, many = FlushingRegistry(), FlushingRegistry()
    by_value, batched = CommandMetrics(one), CommandMetrics(many)
    for i, (command, result, stages) in enumerate(recorded):
        by_value.observe(command, result, stages)
        batched._held.append((command, result, stages))  # record() as inside a running loop
        if i % flush_every == 0:
            batched.flush()
    _assert_same(_samples(many), _samples(one))  # the collect flushes what is still held back
    assert not batched._held


def test_a_stage_that_did_not_run_is_not_observed_but_total_always_is() -> None:
    registry = FlushingRegistry()
    metrics = CommandMetrics(registry)
    metrics.record("JoinRoom", "ok", (0.0,) * len(STAGES))  # no loop: applied at once
    assert registry.get_sample_value("room_commands_total", {"command": "JoinRoom", "result": "ok"}) == 1
    assert registry.get_sample_value("room_command_seconds_count", {"command": "JoinRoom"}) == 1
    for stage in STAGES:
        count = registry.get_sample_value("room_command_stage_seconds_count", {"command": "JoinRoom", "stage": stage})
        assert count == (1 if stage == "total" else 0), stage


async def test_a_turn_of_the_loop_is_applied_once_it_is_over_without_a_collect() -> None:
    registry = FlushingRegistry()
    metrics = CommandMetrics(registry)
    for _ in range(3):
        metrics.record("JoinRoom", "ok", (0.1, 0.2, 0.0, 1.0, 0.0, 0.1, 2.0))
    assert len(metrics._held) == 3  # held back while this turn runs
    await asyncio.sleep(0)  # one turn: the flush the first record scheduled (call_soon, FIFO) runs before us
    assert not metrics._held
    counter = registry.get_sample_value("room_commands_total", {"command": "JoinRoom", "result": "ok"})
    assert counter == 3
    assert registry.get_sample_value("room_command_seconds_sum", {"command": "JoinRoom"}) == pytest.approx(0.006)


async def test_a_collect_sees_commands_recorded_in_the_same_turn() -> None:
    registry = FlushingRegistry()
    metrics = CommandMetrics(registry)
    metrics.record("SendGift", "insufficient_balance", (0.1, 0.2, 0.3, 0.0, 0.0, 0.0, 1.0))
    assert metrics._held  # not applied yet
    labels = {"command": "SendGift", "stage": "wallet_debit"}
    assert registry.get_sample_value("room_command_stage_seconds_count", labels) == 1
    assert registry.get_sample_value("room_commands_total", {"command": "SendGift", "result": "insufficient_balance"})


async def test_command_timing_counts_in_the_process_registry() -> None:
    from roomservice.observability.metrics import REGISTRY

    labels = {"command": "MetricsProbe", "result": "ok"}
    before = REGISTRY.get_sample_value("room_commands_total", labels) or 0.0
    for i in range(5):
        CommandTiming(command="MetricsProbe", app_code="a", room_id="r", command_id=f"c{i}", total_ms=1.0).emit()
    assert REGISTRY.get_sample_value("room_commands_total", labels) == before + 5


held_entries = st.lists(
    st.tuples(
        st.sampled_from(["im_bridge", "activity"]),
        st.one_of(st.none(), st.floats(0, 10, allow_nan=False)),
        st.booleans(),  # with a value: counted too, as one entry (inc_and_observe)
    ),
    max_size=40,
)


@given(held_entries, st.integers(min_value=1, max_value=10))
def test_held_back_increments_and_observations_export_what_direct_ones_do(
    entries: list[tuple[str, float | None, bool]], flush_every: int
) -> None:
    one, many = FlushingRegistry(), FlushingRegistry()
    metrics = []
    for registry in (one, many):
        counter = Counter("c_total", "c", ["group"], registry=registry)
        histogram = Histogram("h_seconds", "h", ["group"], buckets=(0.01, 0.1, 1, 5), registry=registry)
        metrics.append((counter, histogram))
    held = HeldBack(many)
    (c_one, h_one), (c_many, h_many) = metrics
    for i, (group, value, counted) in enumerate(entries):
        if value is None:
            c_one.labels(group).inc()
            held._held.append((c_many.labels(group), None))  # as inc() inside a running loop
        elif counted:
            c_one.labels(group).inc()
            h_one.labels(group).observe(value)
            held._held.append((c_many.labels(group), h_many.labels(group), value))  # as inc_and_observe()
        else:
            h_one.labels(group).observe(value)
            held._held.append((h_many.labels(group), value))
        if i % flush_every == 0:
            held.flush()
    _assert_same(_samples(many), _samples(one))
    assert not held._held


async def test_held_back_is_applied_once_the_turn_is_over() -> None:
    registry = FlushingRegistry()
    counter = Counter("c_total", "c", registry=registry)
    held = HeldBack(registry)
    histogram = Histogram("h_seconds", "h", buckets=(0.01, 0.1, 1), registry=registry)
    held.inc(counter)
    held.inc(counter)
    held.inc_and_observe(counter, histogram, 0.05)
    assert len(held._held) == 3
    await asyncio.sleep(0)  # one turn: the flush the first inc scheduled (call_soon, FIFO) runs before us
    assert not held._held
    assert registry.get_sample_value("c_total") == 3
    assert registry.get_sample_value("h_seconds_count") == 1
    assert registry.get_sample_value("h_seconds_bucket", {"le": "0.1"}) == 1
    assert registry.get_sample_value("h_seconds_bucket", {"le": "0.01"}) == 0
