"""Reading a request body: at most ``max_bytes`` (uvicorn has no limit) and within a deadline (nor has it one).

The route reads the whole body before anything parses it (bodies are small,
64 KiB): an oversized body is ``413 payload_too_large``, a body that has not
fully arrived ``timeout_s`` after the handler started reading it is ``400
invalid_argument`` and the connection is closed (a client trickling a byte at
a time is held for ``timeout_s``, not forever). The deadline covers the whole
body, not the gap between chunks. Headers are read by uvicorn before the app
sees the request; see docs/http.md for what bounds them.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from starlette.requests import Request
from starlette.types import Message, Receive

from roomservice import errors
from roomservice.futures import Started, started

DEADLINE_SCOPE_KEY: Final = "roomservice.body_deadline"  # loop time by which the body must have arrived


class ClosesConnection:
    """Marks an error whose answer carries ``Connection: close`` (the rest of the request is not read)."""


class BodyReadTimeout(ClosesConnection, errors.InvalidArgument):
    """The body did not arrive in time. SPEC §8 has no 408: it is an invalid request."""


class ClientGone(Exception):
    """The client disconnected before sending the whole body: nobody is left to answer."""


async def read_body(request: Request, *, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body of ``request``; raises PayloadTooLarge, BodyReadTimeout or ClientGone.

    The deadline is ``timeout_s`` from now, or the one in the scope (``DEADLINE_SCOPE_KEY``) when a reader
    before this one (:mod:`.fast_path`) started the clock and handed the request on.
    """
    deadline = request.scope.get(DEADLINE_SCOPE_KEY)
    if deadline is None:
        deadline = asyncio.get_running_loop().time() + timeout_s
    return await receive_body(
        request.receive,
        declared=request.headers.get("content-length"),
        max_bytes=max_bytes,
        deadline=deadline,
        timeout_s=timeout_s,
    )


async def receive_body(
    receive: Receive,
    *,
    declared: str | None,
    max_bytes: int,
    deadline: float,
    timeout_s: float,
    consumed: list[Message] | None = None,
) -> bytes:
    """The whole body from ``receive`` by loop time ``deadline``; raises as :func:`read_body`.

    ``declared`` is the Content-Length header; every message received is appended to ``consumed``
    when given (a reader that may hand the request on replays them).
    """
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise errors.PayloadTooLarge(f"request body over {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0

    def take(message: Message) -> bool:
        """Take one message of the body; True once it was the last."""
        nonlocal size
        if consumed is not None:
            consumed.append(message)
        if message["type"] == "http.disconnect":
            raise ClientGone()
        if message["type"] != "http.request":
            return False
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise errors.PayloadTooLarge(f"request body over {max_bytes} bytes")
        chunks.append(chunk)
        return not message.get("more_body", False)

    # A small body has usually arrived with its head: the first receive() then answers without
    # waiting, and no deadline needs arming (asyncio.timeout_at, a timer armed and cancelled, was
    # ~7 us a command request; issue 12). Whatever has to wait runs under the deadline.
    first = started(receive())
    if isinstance(first, Started):
        waiting: Started[Message] | None = first
    elif take(first):
        return _joined(chunks)
    else:
        waiting = None
    try:
        async with asyncio.timeout_at(deadline):
            if waiting is not None and take(await waiting):
                return _joined(chunks)
            while not take(await receive()):
                pass
    except TimeoutError:
        raise BodyReadTimeout(f"request body not received within {timeout_s:g}s") from None
    return _joined(chunks)


def _joined(chunks: list[bytes]) -> bytes:
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


_UNPARSED: Final = object()


def replaying(request: Request, body: bytes, parsed: Any = _UNPARSED) -> Request:
    """A request over the same scope whose body is ``body`` (already read), for the handler to read again.

    ``parsed``: the body's JSON value, already parsed (strictly) by the caller;
    ``request.body()`` and ``request.json()`` then answer from it instead of
    reading and parsing the body a second time.
    """
    delivered = False
    receive = request.receive

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, when it comes

    again = Request(request.scope, replay)
    if parsed is not _UNPARSED:
        again._body = body  # what Request.body() and Request.json() cache after their first read
        again._json = parsed
    return again
