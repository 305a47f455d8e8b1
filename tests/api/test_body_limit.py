"""receive_body arms its deadline only for what has to wait, and whatever has to wait is bounded."""

from __future__ import annotations

import asyncio

import pytest
from starlette.types import Message

from roomservice import errors
from roomservice.api.body_limit import BodyReadTimeout, ClientGone, receive_body


def _receiver(messages: list[Message]) -> tuple[list[Message], object]:
    """A receive() that answers ``messages`` at once, then waits forever."""
    queue = list(messages)

    async def receive() -> Message:
        if queue:
            return queue.pop(0)
        await asyncio.get_running_loop().create_future()  # never done
        raise AssertionError("unreachable")

    return queue, receive


async def _read(receive: object, *, timeout_s: float = 0.05, consumed: list[Message] | None = None) -> bytes:
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout_s + 5):  # a deadline not armed fails the test (TimeoutError), not hangs
        return await receive_body(
            receive,  # type: ignore[arg-type]
            declared=None,
            max_bytes=10,
            deadline=loop.time() + timeout_s,
            timeout_s=timeout_s,
            consumed=consumed,
        )


async def test_a_body_there_at_once_is_read_whole() -> None:
    _, receive = _receiver([{"type": "http.request", "body": b"abc", "more_body": False}])
    consumed: list[Message] = []
    assert await _read(receive, consumed=consumed) == b"abc"
    assert len(consumed) == 1


async def test_chunks_there_at_once_are_joined() -> None:
    _, receive = _receiver([
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"cd", "more_body": False},
    ])
    assert await _read(receive) == b"abcd"


async def test_a_first_chunk_there_at_once_and_the_rest_never_is_a_timeout() -> None:
    _, receive = _receiver([{"type": "http.request", "body": b"ab", "more_body": True}])
    with pytest.raises(BodyReadTimeout):
        await _read(receive)


async def test_a_body_that_never_comes_is_a_timeout() -> None:
    _, receive = _receiver([])
    with pytest.raises(BodyReadTimeout):
        await _read(receive)


async def test_a_body_that_comes_after_a_wait_is_read() -> None:
    gate: asyncio.Future[Message] = asyncio.get_running_loop().create_future()

    async def receive() -> Message:
        return await gate

    asyncio.get_running_loop().call_soon(gate.set_result, {"type": "http.request", "body": b"late"})
    assert await _read(receive, timeout_s=5) == b"late"


async def test_too_large_and_gone_are_raised_at_once_too() -> None:
    _, receive = _receiver([{"type": "http.request", "body": b"x" * 11, "more_body": False}])
    with pytest.raises(errors.PayloadTooLarge):
        await _read(receive)
    _, receive = _receiver([{"type": "http.disconnect"}])
    with pytest.raises(ClientGone):
        await _read(receive)


@pytest.mark.parametrize("declared", ["²", "٣", "12x", ""])
async def test_a_content_length_that_is_no_ascii_number_is_not_trusted_and_no_error(declared: str) -> None:
    """"²".isdigit() is true, and int() refuses it: the header is ignored and the body itself counted."""
    loop = asyncio.get_running_loop()
    _, receive = _receiver([{"type": "http.request", "body": b"{}", "more_body": False}])
    body = await receive_body(
        receive,  # type: ignore[arg-type]
        declared=declared,
        max_bytes=10,
        deadline=loop.time() + 1,
        timeout_s=1,
    )
    assert body == b"{}"
