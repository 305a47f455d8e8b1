"""A long-running process freezes what start-up built and makes young collections rarer (cli/collector.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from roomservice.cli.collector import YOUNG_THRESHOLD, settle_after_start


@pytest.fixture
def restored_collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_start_up_objects_are_frozen_and_young_collections_wait(restored_collector: None) -> None:
    kept = [object() for _ in range(10)]  # alive at start-up: frozen with the rest
    assert gc.is_tracked(kept)
    middle, old = gc.get_threshold()[1:]
    frozen_before = gc.get_freeze_count()
    settle_after_start()
    assert gc.get_freeze_count() > frozen_before
    assert all(o is not kept for o in gc.get_objects(generation=2))  # the permanent generation is not scanned
    assert gc.get_threshold() == (YOUNG_THRESHOLD, middle, old)


def test_cycles_are_still_collected_after_settling(restored_collector: None) -> None:
    settle_after_start()

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # type: ignore[attr-defined]
    del a, b
    assert gc.collect() >= 2
