"""``roomservice.futures.relay``: a future following another, converted, cancellation passed down."""

from __future__ import annotations

import asyncio

import pytest

from roomservice.futures import relay


class Converted(Exception):
    pass


def _convert(exc: BaseException) -> BaseException:
    return Converted(f"converted: {exc}")


async def test_the_result_and_the_failure_arrive_converted() -> None:
    loop = asyncio.get_running_loop()
    ok, bad = loop.create_future(), loop.create_future()
    ok_out, bad_out = relay(ok, lambda n: n * 2, _convert), relay(bad, lambda n: n * 2, _convert)
    assert not ok_out.done() and not bad_out.done()
    ok.set_result(21)
    bad.set_exception(ValueError("nope"))
    assert await ok_out == 42
    with pytest.raises(Converted, match="converted: nope"):
        await bad_out


async def test_cancelling_the_relay_cancels_what_it_follows_and_the_other_way_round() -> None:
    loop = asyncio.get_running_loop()
    inner = loop.create_future()
    outer = relay(inner, lambda n: n, _convert)
    outer.cancel()
    await asyncio.wait([inner])  # done callbacks run on a later turn of the loop
    assert inner.cancelled()

    inner2 = loop.create_future()
    outer2 = relay(inner2, lambda n: n, _convert)
    inner2.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer2
    assert outer2.cancelled()
