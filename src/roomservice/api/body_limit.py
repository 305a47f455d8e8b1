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

from starlette.requests import ClientDisconnect, Request
from starlette.types import Message

from roomservice import errors

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
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise errors.PayloadTooLarge(f"request body over {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        deadline = request.scope.get(DEADLINE_SCOPE_KEY)
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + timeout_s
        async with asyncio.timeout_at(deadline):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise errors.PayloadTooLarge(f"request body over {max_bytes} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyReadTimeout(f"request body not received within {timeout_s:g}s") from None
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


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
