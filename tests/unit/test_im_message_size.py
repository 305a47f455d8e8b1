"""The IM message's ``Data`` (publishers.tencent_im.message_data) against Tencent's 12 KB message body.

Tencent refuses for good a group message whose body is over 12 KB; our body is the custom
element's Data alone (Desc and Ext are empty). A RoomTreasureOpened lists up to 200 recipients
of up to 64 characters (about 13.6 KB): it is sent with the first recipients that fit and says
so; any other event that does not fit is refused before it reaches IM.
"""

from __future__ import annotations

import json

import pytest

from roomservice.domain import events as e
from roomservice.domain.limits import MAX_TREASURE_RECIPIENTS
from roomservice.integrations.tencent_im.client import MSG_BODY_MAX_BYTES
from roomservice.publishers.port import PermanentError
from roomservice.publishers.tencent_im import MessageTooLarge, message_data


def event(payload: e.EventPayload, *, event_id: str = "e" * 32, repair_of: str | None = None) -> e.Event:
    return e.Event(event_id, "demo", "r1", 9, 1_700_000_000_000, payload, repair_of)


def treasure(count: int, id_chars: int = 64, box_id: str = "box-1") -> e.RoomTreasureOpened:
    recipients = tuple(f"{i:04d}".ljust(id_chars, "u") for i in range(count))
    return e.RoomTreasureOpened(box_id=box_id, level=2, recipients=recipients)


def size(data: str) -> int:
    return len(data.encode("utf-8"))


def test_the_limit_is_12_kb() -> None:
    assert MSG_BODY_MAX_BYTES == 12 * 1024


def test_a_message_that_fits_is_the_event_as_it_is() -> None:
    payload = treasure(MAX_TREASURE_RECIPIENTS, id_chars=16)  # 200 short ids fit
    data = json.loads(message_data(event(payload)))
    assert data == {
        "event_id": "e" * 32,
        "type": "RoomTreasureOpened",
        "room_version": 9,
        "payload": {"box_id": "box-1", "level": 2, "recipients": list(payload.recipients)},  # no truncation fields
    }


def test_a_treasure_too_large_keeps_the_most_recipients_that_fit_and_says_so() -> None:
    payload = treasure(MAX_TREASURE_RECIPIENTS)  # 200 ids of 64 characters: ~13.6 KB in full
    assert size(json.dumps({"payload": payload.to_dict()})) > MSG_BODY_MAX_BYTES
    raw = message_data(event(payload))
    assert size(raw) <= MSG_BODY_MAX_BYTES
    sent = json.loads(raw)["payload"]
    kept = len(sent["recipients"])
    assert 0 < kept < MAX_TREASURE_RECIPIENTS and sent["recipients"] == list(payload.recipients[:kept])
    assert sent["recipients_truncated"] is True and sent["recipient_count"] == MAX_TREASURE_RECIPIENTS
    assert (sent["box_id"], sent["level"]) == ("box-1", 2)
    bigger = json.loads(raw)
    bigger["payload"]["recipients"].append(payload.recipients[kept])
    assert size(json.dumps(bigger, separators=(",", ":"), ensure_ascii=False)) > MSG_BODY_MAX_BYTES  # the most


def test_a_truncated_treasure_is_the_same_data_for_a_repair() -> None:
    payload = treasure(MAX_TREASURE_RECIPIENTS)
    original = message_data(event(payload, event_id="a" * 32))
    assert message_data(event(payload, event_id="b" * 32, repair_of="a" * 32)) == original  # same Data, once


def test_a_treasure_that_does_not_fit_even_without_recipients_is_refused() -> None:
    with pytest.raises(MessageTooLarge):
        message_data(event(treasure(3, box_id="b" * MSG_BODY_MAX_BYTES)))


@pytest.mark.parametrize(
    "payload",
    [
        e.RoomUserJoined(user_id="j" * MSG_BODY_MAX_BYTES, role="member"),
        e.RoomGiftSent(sender_id="s", receiver_id="r", gift_id="语" * 4096, count=1, unit_price=1, total_value=1),
    ],
    ids=lambda p: p.type,
)
def test_any_other_event_too_large_is_refused_for_good(payload: e.EventPayload) -> None:
    with pytest.raises(MessageTooLarge, match=f"{payload.type} event e+: its IM message would be") as err:
        message_data(event(payload))
    assert isinstance(err.value, PermanentError) and not err.value.retryable
