"""The command fingerprint stays the sha256 of the stdlib's canonical JSON whichever encoder computes it.

Stored fingerprints decide whether a retried command_id is a replay or a reuse
(409), so the faster orjson path must produce the very same bytes, and any
command it cannot (non-ASCII, escapes) must take the stdlib path.
"""

from __future__ import annotations

import hashlib
import json

from hypothesis import given
from hypothesis import strategies as st

from roomservice.domain import commands as c
from roomservice.service import fingerprint


def reference(command: c.Command) -> str:
    canonical = json.dumps(command.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@given(owner=st.text(max_size=20), title=st.text(max_size=40), seats=st.none() | st.integers(-(2**40), 2**40))
def test_create_room_fingerprint_is_the_stdlib_canonical_json(owner: str, title: str, seats: int | None) -> None:
    command = c.CreateRoom(owner_id=owner, title=title, seat_count=seats)
    assert fingerprint(command) == reference(command)
    assert fingerprint(command, command.to_dict()) == reference(command)


def test_every_command_type_is_fingerprinted_as_before() -> None:
    commands = [
        c.JoinRoom(user_id="alice"),
        c.SendGift(sender_id="a", receiver_id="b", gift_id="rose", count=3),
        c.CreateRoom(owner_id="o", title='quote " and backslash \\ and tab \t'),
        c.CreateRoom(owner_id="o", title="房间 \u2028 \x7f"),
    ]
    for command in commands:
        assert fingerprint(command) == reference(command), command
