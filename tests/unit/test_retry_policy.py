"""The retry policy value object: validation, the backoff schedule, jitter bounds."""

from __future__ import annotations

import random

import pytest

from roomservice.outbox.policy import RetryPolicy


def test_schedule_doubles_from_initial_and_caps_at_max() -> None:
    policy = RetryPolicy(initial_backoff_ms=5_000, max_backoff_ms=300_000, max_retry_count=10, jitter=0)
    assert [policy.backoff_ms(n) for n in range(1, 9)] == [
        5_000, 10_000, 20_000, 40_000, 80_000, 160_000, 300_000, 300_000,
    ]
    assert policy.base_backoff_ms(10_000) == 300_000


def test_jitter_stays_within_its_fraction_and_the_cap() -> None:
    policy = RetryPolicy(initial_backoff_ms=1_000, max_backoff_ms=4_000, max_retry_count=10, jitter=0.2)
    rng = random.Random(7)
    first = [policy.backoff_ms(1, rng=rng) for _ in range(500)]
    assert min(first) >= 800 and max(first) <= 1_200
    assert len(set(first)) > 50  # it really spreads
    capped = [policy.backoff_ms(9, rng=rng) for _ in range(500)]
    assert max(capped) <= 4_000 and min(capped) >= 3_200


def test_exhausted_after_max_retry_count_failures() -> None:
    policy = RetryPolicy(initial_backoff_ms=1, max_backoff_ms=1, max_retry_count=3, jitter=0)
    assert [policy.exhausted(n) for n in (1, 2, 3, 4)] == [False, False, True, True]
    assert RetryPolicy(initial_backoff_ms=1, max_backoff_ms=1, max_retry_count=0).exhausted(1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"initial_backoff_ms": 0}, "initial_backoff"),
        ({"max_backoff_ms": 10}, "max_backoff"),
        ({"max_retry_count": -1}, "max_retry_count"),
        ({"jitter": 1.5}, "jitter"),
    ],
)
def test_invalid_policies_are_refused(kwargs: dict[str, float], message: str) -> None:
    values = {"initial_backoff_ms": 100, "max_backoff_ms": 1_000, "max_retry_count": 3, "jitter": 0.1, **kwargs}
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**values)  # type: ignore[arg-type]
