"""Futures without a task or a timer each.

``relay``: a future that follows another one, its result or failure converted (pipelined
publishes: each layer an acknowledgement passes speaks its own errors, and relays the future
below with its own conversion, without a task per message).

``started`` / ``within``: an awaitable run up to its first wait, so that a deadline is armed
only for what has to wait (a small request body already there, an in-process IM call).

``Deadlines``: futures that must be done by a deadline of their own, kept by ONE timer armed
for the earliest instead of an ``asyncio.timeout`` (a timer armed and cancelled) per future:
the outbox worker's pipelined acknowledgements, the group commit's saves and the SQLite units
(issue 12: ~7-10 us of CPU per timer on this machine).

``Bounds``: the same for blocks of code: ``async with bounds.until(deadline)`` is
``async with asyncio.timeout_at(deadline)`` (the task is cancelled at the deadline, the block raises
``TimeoutError``, a cancellation from elsewhere stays a cancellation), with one timer for every
block in flight: the outbox worker's publish attempts, one per row and target.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Generic, Protocol, TypeVar, cast

T = TypeVar("T")
U = TypeVar("U")


def relay(
    inner: asyncio.Future[T], result: Callable[[T], U], failure: Callable[[BaseException], BaseException]
) -> asyncio.Future[U]:
    """A future done when ``inner`` is: ``result(inner.result())``, or ``inner``'s exception as
    ``failure`` converts it, or cancelled. Cancelling it cancels ``inner`` (the layer below can
    let go of what it keeps for the outstanding answer). The conversions must not raise."""
    outer: asyncio.Future[U] = inner.get_loop().create_future()

    def forward(done: asyncio.Future[T]) -> None:
        if outer.done():
            return
        if done.cancelled():
            outer.cancel()
            return
        exc = done.exception()
        if exc is None:
            outer.set_result(result(done.result()))
        else:
            outer.set_exception(failure(exc))

    def back(done: asyncio.Future[U]) -> None:
        if done.cancelled() and not inner.done():
            inner.cancel()

    inner.add_done_callback(forward)
    outer.add_done_callback(back)
    return outer


class Started(Generic[T]):
    """An awaitable run up to its first wait (:func:`started`); awaiting this goes on from there,
    as awaiting the awaitable itself would have: what the task is sent or thrown (a cancellation)
    is passed on to it."""

    __slots__ = ("_it", "_yielded")

    def __init__(self, it: Generator[Any, Any, T], yielded: Any) -> None:
        self._it, self._yielded = it, yielded

    def __await__(self) -> Generator[Any, Any, T]:
        it, yielded = self._it, self._yielded
        while True:
            try:
                sent = yield yielded
            except GeneratorExit:
                it.close()
                raise
            except BaseException as exc:
                try:
                    yielded = it.throw(exc)
                except StopIteration as stop:
                    return cast(T, stop.value)
            else:
                try:
                    yielded = it.send(sent)
                except StopIteration as stop:
                    return cast(T, stop.value)


def started(awaitable: Awaitable[T]) -> T | Started[T]:
    """Run ``awaitable`` until it has to wait: its result when it did not have to, else a
    :class:`Started` to await for the rest (under a deadline, for instance). What it raises before
    it waits is raised here."""
    it = awaitable.__await__()
    try:
        yielded = it.send(None)
    except StopIteration as stop:
        return cast(T, stop.value)
    return Started(it, yielded)


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """``async with asyncio.timeout(timeout_s): return await awaitable``, the timer armed only if
    ``awaitable`` has to wait: one that answers at once (an in-process call) cannot have run out
    of time, as a timer could only have fired once it waited. The deadline is counted from the
    call, as the timeout's would be."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    first = started(awaitable)
    if not isinstance(first, Started):
        return first
    async with asyncio.timeout_at(deadline):
        return await first


class Watched(Protocol):
    """What :class:`Deadlines` watches: a future, or anything that says when it is done and on which loop."""

    def done(self) -> bool: ...

    def get_loop(self) -> asyncio.AbstractEventLoop: ...


W = TypeVar("W", bound=Watched)


class Deadlines(Generic[W]):
    """Futures watched until their deadline (``loop.time()`` seconds): one past it and not done yet
    is handed to ``on_expiry``, which must make it done (fail it, or cancel it). ONE timer, armed
    for the earliest deadline of a future not done; a future done before its deadline costs nothing
    more than its place in the heap until the timer or the next ``watch`` passes it."""

    __slots__ = ("_heap", "_on_expiry", "_order", "_timer", "_timer_at", "_timer_loop")

    def __init__(self, on_expiry: Callable[[W], None]) -> None:
        self._on_expiry = on_expiry
        self._heap: list[tuple[float, int, W]] = []
        self._order = itertools.count()  # ties: first come, first expired; futures are never compared
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    def watch(self, future: W, deadline: float) -> None:
        heap = self._heap
        while heap and heap[0][2].done():  # done before their deadline: nothing left to expire
            heapq.heappop(heap)
        heapq.heappush(heap, (deadline, next(self._order), future))
        loop = future.get_loop()
        # (a timer of a loop since closed never fires: a new loop arms its own)
        if self._timer is None or self._timer_loop is not loop or deadline < self._timer_at:
            self._arm(loop, heap[0][0])

    def close(self) -> list[W]:
        """Stop watching; returns the futures watched that are not done yet."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending = [future for _, _, future in self._heap if not future.done()]
        self._heap.clear()
        return pending

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at, self._timer_loop = loop.call_at(at, self._expire, loop), at, loop

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        heap, now = self._heap, loop.time()
        while heap:
            deadline, _, future = heap[0]
            if not future.done():
                if deadline > now:
                    self._arm(loop, deadline)
                    return
                self._on_expiry(future)
            heapq.heappop(heap)


# A bounded block's states, as asyncio.Timeout's.
_ENTERED, _EXPIRING, _EXITED = 1, 2, 3


class Bounds:
    """Time bounds of ``async with`` blocks (see the module doc), kept by one :class:`Deadlines`: a
    block that ends before its deadline (almost all) costs a heap entry, dropped when the timer or
    a later block passes it; not an armed and cancelled timer of its own."""

    __slots__ = ("_deadlines",)

    def __init__(self) -> None:
        self._deadlines: Deadlines[_Bound] = Deadlines(_Bound.expire)

    def until(self, deadline: float) -> _Bound:
        """A block bounded by ``deadline`` (``loop.time()`` seconds), however late it is entered."""
        return _Bound(self._deadlines, deadline)


class _Bound:
    __slots__ = ("deadline", "deadlines", "state", "task")

    def __init__(self, deadlines: Deadlines[_Bound], deadline: float) -> None:
        self.deadlines, self.deadline = deadlines, deadline
        self.state = 0
        self.task: asyncio.Task[Any] | None = None

    async def __aenter__(self) -> _Bound:
        return self.enter()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.exit(exc)

    def enter(self) -> _Bound:
        """What ``async with`` does on the way in, without a coroutine of its own (a hot path pairs it
        with :meth:`exit` in ``try``: the outbox worker, once per row and target)."""
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a bound must be entered in a task")
        self.task, self.state = task, _ENTERED
        self.deadlines.watch(self, self.deadline)
        return self

    def exit(self, exc: BaseException | None) -> None:
        """What ``async with`` does on the way out, the block having raised ``exc`` (None: it did not):
        raises :class:`TimeoutError` from ``exc`` when the bound's own cancellation ended the block."""
        expiring = self.state == _EXPIRING
        self.state = _EXITED
        # as asyncio.Timeout: the cancellation is ours only when no one else cancelled the task too
        if expiring and self.task is not None and self.task.uncancel() == 0 and type(exc) is asyncio.CancelledError:
            raise TimeoutError from exc

    def done(self) -> bool:  # (for Deadlines: expiring or exited, there is nothing left to expire)
        return self.state != _ENTERED

    def get_loop(self) -> asyncio.AbstractEventLoop:
        assert self.task is not None
        return self.task.get_loop()

    def expire(self) -> None:
        self.state = _EXPIRING
        if self.task is not None:
            self.task.cancel()


class Slots:
    """At most ``n`` holders at once, first come first served: ``asyncio.Semaphore`` without its cost
    while a slot is free. A holder takes one with :meth:`take_now` (no coroutine, and no walk over the
    waiters, which 3.11's ``Semaphore.acquire`` makes on every call: ~0.4 µs, once per row and target in
    the outbox worker) and waits with ``await take()`` only when none is; :meth:`give` hands the slot
    straight to the first waiter. A waiter cancelled after it was handed one passes it on."""

    __slots__ = ("_free", "_waiters")

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError("a Slots needs at least one slot")
        self._free = n
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def take_now(self) -> bool:
        """Take a slot if one is free and no one waits for one; False otherwise (then ``await take()``)."""
        if self._free and not self._waiters:
            self._free -= 1
            return True
        return False

    async def take(self) -> None:
        """Take a slot, waiting behind the earlier waiters for one to be given back."""
        if self.take_now():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # handed a slot as this was cancelled: pass it on
                self.give()
            raise  # (cancelled while it waited: the next give() passes over it)

    def give(self) -> None:
        """Give a slot back: to the first waiter still waiting, else to the free ones (while one is
        free no one waits: a waiter is only queued when none is)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1
