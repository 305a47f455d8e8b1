"""The treasure-open group: a due wake-up opens the box through the command pipeline; early ones come back."""

from __future__ import annotations

from typing import Any

import pytest

from roomservice import errors
from roomservice.brokers.port import Delivery
from roomservice.consumers.runtime import Outcome, Redeliver
from roomservice.consumers.treasure_open import TOO_EARLY_MAX_S, TreasureOpenHandler
from roomservice.domain.commands import OpenTreasure
from roomservice.timers.delay_message import TreasureWakeup

NOW = 1_780_000_000_000


class Opener:
    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, str, str, OpenTreasure]] = []

    async def __call__(self, app: str, room: str, command_id: str, command: OpenTreasure) -> object:
        self.calls.append((app, room, command_id, command))
        answer = self.answers.pop(0) if self.answers else {"replayed": False}
        if isinstance(answer, BaseException):
            raise answer
        return answer


def delivery(open_at_ms: int = NOW, body: bytes | None = None, count: int = 1) -> Delivery:
    wakeup = TreasureWakeup("demo", "r1", "20260528-1", 1, open_at_ms, "treasure-open:20260528-1")
    return Delivery(
        topic="hyapp_room_treasure_open",
        group="hyapp-room-treasure-open",
        message_id="1",
        key=wakeup.key,
        tag="TreasureOpen",
        sharding_key="demo:r1",
        body=wakeup.encode() if body is None else body,
        headers={},
        delivery_count=count,
        published_at_ms=NOW - 60_000,
    )


def handler(opener: Opener, now: int = NOW) -> TreasureOpenHandler:
    return TreasureOpenHandler(opener, group="hyapp-room-treasure-open", topic="t", clock=lambda: now)


async def test_a_due_wakeup_sends_open_treasure_with_the_messages_command_id() -> None:
    opener = Opener()
    assert await handler(opener).handle(delivery()) is Outcome.APPLIED
    assert opener.calls == [
        ("demo", "r1", "treasure-open:20260528-1", OpenTreasure(box_id="20260528-1", level=1, open_at_ms=NOW))
    ]


async def test_a_redelivered_wakeup_is_a_replay_of_the_same_command() -> None:
    assert await handler(Opener({"replayed": True})).handle(delivery()) is Outcome.DUPLICATE


async def test_an_early_wakeup_comes_back_at_open_at_without_asking_the_room() -> None:
    opener = Opener()
    with pytest.raises(Redeliver) as again:
        await handler(opener, now=NOW - 1500).handle(delivery())
    assert again.value.delay_s == pytest.approx(1.5)
    assert opener.calls == []


async def test_the_rooms_too_early_answer_is_redelivered_at_its_open_at() -> None:
    with pytest.raises(Redeliver) as again:
        await handler(Opener(errors.TreasureTooEarly(NOW + 2000))).handle(delivery())
    assert again.value.delay_s == pytest.approx(2.0)


async def test_a_room_whose_clock_is_behind_is_asked_again_after_a_doubling_floor() -> None:
    """This process finds the box due; the room's owner, its clock behind, answers "too early" for a
    time already past here. Each redelivery counts against the group's limit: a fixed 50 ms wait spent
    all 17 in under a second of skew and dead-lettered the box (found by review). The floor doubles."""
    delays = []
    for count in range(1, 17):
        with pytest.raises(Redeliver) as again:
            await handler(Opener(errors.TreasureTooEarly(NOW))).handle(delivery(count=count))
        delays.append(again.value.delay_s)
    assert delays[:4] == pytest.approx([0.1, 0.2, 0.4, 0.8])
    assert max(delays) == TOO_EARLY_MAX_S
    assert sum(delays) > 180  # minutes of skew before the group's limit (16 redeliveries), not a second


async def test_an_answer_retrying_cannot_change_is_acknowledged() -> None:
    assert await handler(Opener(errors.RoomNotFound())).handle(delivery()) is Outcome.APPLIED


async def test_an_outage_fails_the_delivery_for_a_retry() -> None:
    with pytest.raises(errors.Unavailable):
        await handler(Opener(errors.Unavailable())).handle(delivery())


@pytest.mark.parametrize(
    "answer",
    [errors.RoomServiceError("internal error"), errors.Unauthorized("wrong peer secret")],
    ids=["internal", "unauthorized"],
)
async def test_a_failure_at_the_rooms_owner_is_retried_not_dropped(answer: errors.RoomServiceError) -> None:
    """What the gRPC hop brings back for an owner's unexpected exception (``internal``) or a peer secret
    being rotated (``unauthorized``) is no rule of the room: retried, as the same failure here is
    (found by review: acknowledged as dropped, the box never opened). The real hop: test_grpc_api.py."""
    with pytest.raises(errors.RoomServiceError):
        await handler(Opener(answer)).handle(delivery())


async def test_a_body_that_is_no_wakeup_fails_as_poison() -> None:
    with pytest.raises(ValueError, match="not a treasure wake-up"):
        await handler(Opener()).handle(delivery(body=b"{}"))
    with pytest.raises(ValueError, match="not a treasure wake-up"):  # deeper than the JSON parser's stack
        await handler(Opener()).handle(delivery(body=b"[" * 30_000 + b"]" * 30_000))
