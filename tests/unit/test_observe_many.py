"""observe_many: a batch of observations counts exactly as observing them one by one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from roomservice.observability.metrics import observe_many

BUCKETS = (0.001, 0.01, 0.1, 1, 10)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for metric in registry.collect()
        for s in metric.samples
        if not s.name.endswith("_created")
    }


def _pair() -> tuple[CollectorRegistry, Histogram, CollectorRegistry, Histogram]:
    one, many = CollectorRegistry(), CollectorRegistry()
    return (
        one,
        Histogram("h", "h", ["target"], buckets=BUCKETS, registry=one),
        many,
        Histogram("h", "h", ["target"], buckets=BUCKETS, registry=many),
    )


values = st.lists(
    st.one_of(st.sampled_from([0.0, *BUCKETS, 100.0]), st.floats(min_value=0, max_value=50, allow_nan=False)),
    max_size=50,
)


@given(values)
def test_a_batch_counts_as_its_values_observed_one_by_one(batch: list[float]) -> None:
    one, h_one, many, h_many = _pair()
    child = h_one.labels("x")
    for v in batch:
        child.observe(v)
    observe_many(h_many.labels("x"), batch)
    got, want = _samples(many), _samples(one)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), key


def test_a_histogram_without_the_client_internals_is_observed_value_by_value() -> None:
    seen: list[float] = []

    class Plain:
        def observe(self, value: float) -> None:
            seen.append(value)

    observe_many(Plain(), [0.5, 2.0])
    assert seen == [0.5, 2.0]
