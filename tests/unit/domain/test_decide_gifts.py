"""SPEC §3: SendGift — membership, the catalog, catalog prices and heat."""

from __future__ import annotations

import dataclasses

import pytest

from roomservice import errors
from roomservice.domain import commands as c
from roomservice.domain import events as e
from roomservice.domain.rules import Gift, RoomRules


def test_gift_emits_gift_sent_priced_from_the_catalog(open_room):
    assert open_room.gift("alice", "bob", "heart", count=3) == [
        e.RoomGiftSent(sender_id="alice", receiver_id="bob", gift_id="heart", count=3, unit_price=100, total_value=300)
    ]


def test_the_client_cannot_name_a_price():
    assert {f.name for f in dataclasses.fields(c.SendGift)} == {"sender_id", "receiver_id", "gift_id", "count"}


def test_price_follows_the_catalog_of_the_rules(make_room):
    r = make_room(rules=RoomRules(gifts={"heart": Gift(id="heart", name="Heart", price=7)}))
    r.create()
    r.join("alice")
    [sent] = r.gift("alice", "owner", "heart", count=4)
    assert (sent.unit_price, sent.total_value) == (7, 28)


def test_gift_adds_its_value_to_heat(open_room):
    open_room.gift("alice", "bob", "heart", count=2)
    open_room.gift("bob", "owner", "rose", count=5)
    assert open_room.live.heat == 250


@pytest.mark.parametrize("sender", ["carol", "nobody"])
def test_sender_must_be_a_member(open_room, sender):
    with pytest.raises(errors.NotMember) as info:
        open_room.gift(sender, "bob", "rose")
    assert info.value.code == "not_member"
    assert open_room.live.heat == 0


def test_receiver_must_be_a_member(open_room):
    with pytest.raises(errors.NotMember):
        open_room.gift("alice", "carol", "rose")
    assert open_room.live.heat == 0


def test_former_member_can_neither_send_nor_receive(open_room):
    open_room.send(c.LeaveRoom(user_id="bob"))
    with pytest.raises(errors.NotMember):
        open_room.gift("bob", "alice", "rose")
    with pytest.raises(errors.NotMember):
        open_room.gift("alice", "bob", "rose")


def test_absent_owner_cannot_receive_gifts(open_room):
    open_room.send(c.LeaveRoom(user_id="owner"))
    with pytest.raises(errors.NotMember):
        open_room.gift("alice", "owner", "rose")


@pytest.mark.parametrize("gift_id", ["unicorn", "", "ROSE"])
def test_gift_not_in_the_catalog_is_unknown_gift(open_room, gift_id):
    before = open_room.live
    with pytest.raises(errors.UnknownGift) as info:
        open_room.gift("alice", "bob", gift_id)
    assert info.value.code == "unknown_gift"
    assert open_room.live == before


def test_gift_to_oneself_counts(open_room):
    [sent] = open_room.gift("alice", "alice", "rose")
    assert sent.total_value == 10


def test_heat_never_resets_at_the_utc_day_boundary(open_room):
    open_room.gift("alice", "bob", "heart")
    open_room.at(open_room.MIDNIGHT_MS + 5)
    open_room.gift("alice", "bob", "heart")
    assert open_room.live.heat == 200
    assert open_room.live.treasure.energy == 100
