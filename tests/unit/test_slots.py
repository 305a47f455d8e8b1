"""``roomservice.futures.Slots``: a counting semaphore that costs nothing more than a check while a slot is free."""

from __future__ import annotations

import asyncio

import pytest

from roomservice.futures import Slots


async def _waiting(task: asyncio.Task[None]) -> None:
    """Let ``task`` run until it waits for a slot."""
    for _ in range(3):
        await asyncio.sleep(0)
    assert not task.done()


def test_slots_are_taken_up_to_their_number_and_given_back() -> None:
    slots = Slots(2)
    assert slots.take_now() and slots.take_now()
    assert not slots.take_now()
    slots.give()
    assert slots.take_now()
    assert not slots.take_now()


def test_a_slots_needs_at_least_one_slot() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Slots(0)


async def test_waiters_are_served_first_come_first_served_and_before_a_newcomer() -> None:
    slots = Slots(1)
    assert slots.take_now()
    order: list[str] = []

    async def holder(name: str) -> None:
        await slots.take()
        order.append(name)

    first = asyncio.create_task(holder("first"))
    await _waiting(first)
    second = asyncio.create_task(holder("second"))
    await _waiting(second)
    slots.give()  # straight to the first waiter
    assert not slots.take_now()  # a newcomer does not overtake the one waiting
    await first
    slots.give()
    await second
    assert order == ["first", "second"]
    slots.give()
    assert slots.take_now()  # every slot back: free again


async def test_a_waiter_cancelled_while_it_waits_is_passed_over() -> None:
    slots = Slots(1)
    assert slots.take_now()
    gone = asyncio.create_task(slots.take())
    await _waiting(gone)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    slots.give()
    assert slots.take_now()  # the slot went back to the free ones, not to the cancelled waiter
    assert not slots.take_now()


async def test_a_waiter_cancelled_after_it_was_handed_a_slot_passes_it_on() -> None:
    slots = Slots(1)
    assert slots.take_now()
    handed = asyncio.create_task(slots.take())
    await _waiting(handed)
    next_in_line = asyncio.create_task(slots.take())
    await _waiting(next_in_line)
    slots.give()  # handed to the first waiter...
    handed.cancel()  # ...which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await handed
    async with asyncio.timeout(5):
        await next_in_line  # the slot went on to the next
    assert not slots.take_now()  # and only one slot is held
