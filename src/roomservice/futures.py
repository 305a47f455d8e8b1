"""``relay``: a future that follows another one, its result or failure converted (pipelined publishes).

A pipelined publish hands its caller a future of the acknowledgement instead of awaiting
it; each layer it passes (the broker adapter, the broker publisher) speaks its own errors,
so each relays the future below with its own conversion, without a task per message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

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
