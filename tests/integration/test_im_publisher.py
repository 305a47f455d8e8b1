"""The Tencent IM publisher: the real client against the IM sandbox over loopback HTTP, with
our own sent-step record (``im_sent_event``) on SQLite and MariaDB.

Covers SPEC §3's routing for the ``im`` target and §5's publisher: EnsureGroup (owner
imported first; 10025 is success, 10021 too when the group is ours by type and owner, else
permanent), one custom message per room event (``Data`` and ``Random``; at most 12 KB: a
RoomTreasureOpened's recipients cut to fit, any other event too large refused before IM is
called), deduplication by Tencent's 5-minute ``Random`` window and,
beyond it, by our own record; membership control by group type; RoomClosed's message
then destroy; error classification (outage, 10004, UserSig expiry, deadline); and a
retry after a partial failure re-sending only the steps that did not happen; and a
group missing for an open room (dismissed by IM, or forgotten by a restarted one) ensured
again from ``room_meta`` before the step, but never for a closed room.

Requests are counted per command with the sandbox's request log (``request_counts``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
import sqlalchemy as sa
from tests.conftest import count_calls

from roomservice.domain import events as e
from roomservice.integrations.im_sandbox import RunningSandbox, running_sandbox
from roomservice.integrations.im_sandbox.state import OutageMode
from roomservice.integrations.tencent_im.client import (
    MSG_BODY_MAX_BYTES,
    TencentImClient,
    account_id_for,
    group_id_for,
    random_for,
)
from roomservice.integrations.tencent_im.errors import ImPermanentError
from roomservice.publishers.port import PermanentError, RetryableError
from roomservice.publishers.tencent_im import (
    DESTROY,
    GROUP,
    MEMBER,
    MESSAGE,
    MessageTooLarge,
    SentSteps,
    TencentImPublisher,
)
from roomservice.store import tables as t
from roomservice.store.database import Database
from roomservice.wire import encode_event

APP_ID = 1_400_000_042
KEY = "publisher-test-key"
ADMIN = "administrator"
APP, ROOM = "demo", "r1"
OWNER = "alice"
AV, PUBLIC = "AVChatRoom", "Public"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# --------------------------------------------------------------------------- fixtures


@pytest_asyncio.fixture
async def sandbox() -> AsyncIterator[RunningSandbox]:
    # no server-side rate limit: a test's bursts must never meet Tencent's 200/s
    async with running_sandbox(APP_ID, KEY, rate_limit_per_second=None) as running:
        yield running


@pytest_asyncio.fixture
async def client(sandbox: RunningSandbox) -> AsyncIterator[TencentImClient]:
    async with TencentImClient(
        base_url=sandbox.base_url,
        sdk_app_id=APP_ID,
        admin_identifier=ADMIN,
        secret_key=KEY,
        request_timeout=5.0,
        transport=sandbox.transport(),
    ) as im:
        yield im


Make = Callable[..., TencentImPublisher]


@pytest.fixture
def make_publisher(client: TencentImClient, database: Database) -> Make:
    def make(group_type: str = AV) -> TencentImPublisher:
        return TencentImPublisher(client, SentSteps(database, clock=now_ms), group_type=group_type)

    return make


@pytest.fixture
def publisher(make_publisher: Make) -> TencentImPublisher:
    return make_publisher(AV)


# --------------------------------------------------------------------------- helpers


def event(payload: e.EventPayload, version: int = 2, *, room: str = ROOM, event_id: str | None = None) -> e.Event:
    return e.Event(event_id or uuid.uuid4().hex, APP, room, version, now_ms(), payload)


def created(owner: str = OWNER, *, room: str = ROOM, title: str = "Room one") -> e.Event:
    return event(e.RoomCreated(owner_id=owner, title=title, seat_count=8), 1, room=room)


def joined(user: str = "bob", version: int = 2) -> e.Event:
    return event(e.RoomUserJoined(user_id=user, role="member"), version)


def kicked(target: str = "carol", ban_seconds: int = 600, version: int = 5) -> e.Event:
    return event(
        e.RoomUserKicked(
            operator_id=OWNER, target_id=target, ban_seconds=ban_seconds, banned_until_ms=now_ms() + ban_seconds * 1000
        ),
        version,
    )


def closed(version: int = 9) -> e.Event:
    return event(e.RoomClosed(operator_id=OWNER), version)


async def publish(pub: TencentImPublisher, ev: e.Event, *, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    await pub.publish(ev, payload=encode_event(ev), deadline=deadline)


def group_of(room: str = ROOM, group_type: str = AV) -> str:
    return group_id_for(APP, room, group_type=group_type)


def counts(sandbox: RunningSandbox) -> dict[str, int]:
    return sandbox.state.request_counts()


def since(sandbox: RunningSandbox, before: dict[str, int]) -> dict[str, int]:
    """Requests per command made since ``before`` (a :func:`counts` snapshot)."""
    return {k: n - before.get(k, 0) for k, n in counts(sandbox).items() if n != before.get(k, 0)}


async def delta(sandbox: RunningSandbox, action: Awaitable[Any]) -> dict[str, int]:
    """The requests per command that ``action`` made."""
    before = counts(sandbox)
    await action
    return since(sandbox, before)


def errors_of(sandbox: RunningSandbox, command: str) -> list[int]:
    return [r.error_code for r in sandbox.state.requests if r.command == command]


def custom_data(sandbox: RunningSandbox, group_type: str = AV) -> list[dict[str, Any]]:
    return [json.loads(m.data or "null") for m in sandbox.state.messages(group_of(group_type=group_type))]


async def wipe_steps(db: Database) -> None:
    async with db.write() as conn:
        await conn.execute(sa.delete(t.im_sent_event))


async def room_with_group(pub: TencentImPublisher) -> str:
    await publish(pub, created())
    return pub.group_of(APP, ROOM)


# --------------------------------------------------------------------------- RoomCreated -> EnsureGroup


@pytest.mark.parametrize("group_type", [AV, PUBLIC])
async def test_room_created_imports_owner_and_creates_group_of_configured_type(
    make_publisher: Make, sandbox: RunningSandbox, group_type: str
) -> None:
    pub = make_publisher(group_type)
    ev = created(title="Friday night")
    made = await delta(sandbox, publish(pub, ev))
    assert made == {"account_import": 1, "create_group": 1}
    assert [r.command for r in sandbox.state.requests] == ["account_import", "create_group"]  # owner first
    assert OWNER in sandbox.state.accounts
    group = sandbox.state.group(group_of(group_type=group_type))
    assert group is not None
    assert (group.type, group.owner, group.name) == (group_type, OWNER, "Friday night")
    assert await pub.steps.done(ev.event_id) == {GROUP}
    assert await delta(sandbox, publish(pub, ev)) == {}  # done: not even an account_import


async def test_second_room_created_for_the_same_room_is_success(
    publisher: TencentImPublisher, sandbox: RunningSandbox
) -> None:
    await publish(publisher, created())
    again = created()  # e.g. a replayed or repaired RoomCreated: another event id, same room and owner
    await publish(publisher, again)
    assert errors_of(sandbox, "create_group") == [0, 10025]
    assert await publisher.steps.done(again.event_id) == {GROUP}
    assert len(sandbox.state.groups) == 1


async def test_group_id_taken_by_another_owner_is_permanent(
    publisher: TencentImPublisher, client: TencentImClient, sandbox: RunningSandbox
) -> None:
    await client.account_import("mallory")
    await client.create_group(group_of(), "mallory", "Not yours", AV)
    ev = created()
    with pytest.raises(PermanentError, match="10021"):
        await publish(publisher, ev)
    assert await publisher.steps.done(ev.event_id) == set()
    group = sandbox.state.group(group_of())
    assert group is not None and group.owner == "mallory"


async def test_injected_10021_is_permanent(publisher: TencentImPublisher, sandbox: RunningSandbox) -> None:
    sandbox.state.inject_error("create_group", 10021, "used by someone else", count=1)
    with pytest.raises(PermanentError):
        await publish(publisher, created())


async def test_create_room_synchronous_path_and_its_safety_net(
    publisher: TencentImPublisher, sandbox: RunningSandbox
) -> None:
    await publisher.ensure_group(app_code=APP, room_id=ROOM, owner_id=OWNER, title="Sync")
    group = sandbox.state.group(group_of())
    assert group is not None and (group.type, group.owner, group.name) == (AV, OWNER, "Sync")
    await publisher.ensure_group(app_code=APP, room_id=ROOM, owner_id=OWNER, title="Sync")  # 10025: fine
    ev = created(title="Sync")
    await publish(publisher, ev)  # the RoomCreated row afterwards: 10025 is success
    assert errors_of(sandbox, "create_group") == [0, 10025, 10025]
    assert await publisher.steps.done(ev.event_id) == {GROUP}


@pytest.mark.parametrize("answers_10021", [False, True], ids=["10025", "10021"])
async def test_a_group_of_ours_that_exists_is_success_whichever_code_im_answers(
    publisher: TencentImPublisher, sandbox: RunningSandbox, answers_10021: bool
) -> None:
    # Tencent words 10025 for the operator (our admin), so it may answer 10021 for a group we made
    sandbox.state.owned_group_answers_10021 = answers_10021
    await publisher.ensure_group(app_code=APP, room_id=ROOM, owner_id=OWNER, title="Sync")  # CreateRoom's
    await publisher.ensure_group(app_code=APP, room_id=ROOM, owner_id=OWNER, title="Sync")  # e.g. a retry
    ev = created(title="Sync")
    await publish(publisher, ev)  # the RoomCreated row afterwards, its safety net
    code = 10021 if answers_10021 else 10025
    assert errors_of(sandbox, "create_group") == [0, code, code]
    assert counts(sandbox).get("get_group_info", 0) == (2 if answers_10021 else 0)  # asked only after a 10021
    assert await publisher.steps.done(ev.event_id) == {GROUP}
    group = sandbox.state.group(group_of())
    assert group is not None and (group.type, group.owner) == (AV, OWNER) and len(sandbox.state.groups) == 1


@pytest.mark.parametrize(
    ("owner", "group_type"), [("mallory", AV), (OWNER, PUBLIC)], ids=["another-owner", "another-type"]
)
async def test_a_10021_for_a_group_not_ours_stays_permanent(
    publisher: TencentImPublisher, client: TencentImClient, sandbox: RunningSandbox, owner: str, group_type: str
) -> None:
    sandbox.state.owned_group_answers_10021 = True
    await client.account_import(owner)
    await client.create_group(group_of(), owner, "Not ours", group_type)
    ev = created()
    with pytest.raises(PermanentError, match="10021"):
        await publish(publisher, ev)
    assert counts(sandbox)["get_group_info"] == 1
    assert await publisher.steps.done(ev.event_id) == set()
    with pytest.raises(ImPermanentError, match="10021"):
        await publisher.ensure_group(app_code=APP, room_id=ROOM, owner_id=OWNER, title="Mine")


async def test_ensure_group_with_long_ids(publisher: TencentImPublisher, sandbox: RunningSandbox) -> None:
    owner, room = "o" * 64, "R" * 48  # valid ids, longer than Tencent's 32-byte UserID and 48-byte group id
    await publisher.ensure_group(app_code=APP, room_id=room, owner_id=owner, title="Long")
    group = sandbox.state.group(group_of(room))
    assert group is not None and group.group_id.startswith("roomh_")
    assert group.owner == account_id_for(owner) and len(group.owner.encode()) <= 32


async def test_ensure_group_taken_by_another_owner_raises(
    publisher: TencentImPublisher, client: TencentImClient
) -> None:
    await client.account_import("mallory")
    await client.create_group(group_of(), "mallory", "Not yours", AV)
    with pytest.raises(ImPermanentError, match="10021"):  # the caller times it and never fails the command
        await publisher.ensure_group(app_code=APP, room_id=ROOM, owner_id=OWNER, title="Mine")


# --------------------------------------------------------------------------- room events -> one custom message


@pytest.mark.parametrize(
    "payload",
    [
        e.RoomUserJoined(user_id="bob", role="member"),
        e.RoomMicTaken(user_id="bob", seat=3),
        e.RoomGiftSent(sender_id="bob", receiver_id=OWNER, gift_id="rose", count=3, unit_price=10, total_value=30),
        e.RoomTreasureCountdownStarted(box_id="d-1", level=1, open_at_ms=123, open_command_id="treasure-open:d-1"),
        e.RoomTreasureOpened(box_id="d-1", level=1, recipients=(OWNER, "bob")),
    ],
    ids=lambda p: p.type,
)
async def test_room_event_is_one_custom_message(
    publisher: TencentImPublisher, sandbox: RunningSandbox, payload: e.EventPayload
) -> None:
    await room_with_group(publisher)
    ev = event(payload, 7)
    assert await delta(sandbox, publish(publisher, ev)) == {"send_group_msg": 1}
    (message,) = sandbox.state.messages(group_of())
    assert message.random == random_for(ev.event_id)
    assert message.from_account == ADMIN
    assert [elem["MsgType"] for elem in message.msg_body] == ["TIMCustomElem"]
    data = json.loads(message.data or "null")
    assert data == {
        "event_id": ev.event_id,
        "type": payload.type,
        "room_version": 7,
        "payload": json.loads(json.dumps(payload.to_dict())),
    }
    assert await publisher.steps.done(ev.event_id) == {MESSAGE}


async def test_a_treasure_opened_too_large_for_one_message_lists_the_recipients_that_fit(
    publisher: TencentImPublisher, sandbox: RunningSandbox
) -> None:
    await room_with_group(publisher)
    recipients = tuple(f"user-{i:03d}-".ljust(64, "x") for i in range(200))  # the most a box has, longest ids
    payload = e.RoomTreasureOpened(box_id="d-1", level=3, recipients=recipients)
    full = json.dumps({"event_id": "x" * 32, "type": payload.type, "room_version": 7, "payload": payload.to_dict()})
    assert len(full.encode()) > MSG_BODY_MAX_BYTES  # all of them would make Tencent refuse it for good
    ev = event(payload, 7)
    assert await delta(sandbox, publish(publisher, ev)) == {"send_group_msg": 1}
    assert errors_of(sandbox, "send_group_msg") == [0]
    (message,) = sandbox.state.messages(group_of())
    raw = message.data or ""
    assert len(raw.encode()) <= MSG_BODY_MAX_BYTES
    data = json.loads(raw)
    sent = data["payload"]
    kept = len(sent["recipients"])
    assert 150 < kept < 200 and sent["recipients"] == list(recipients[:kept])  # the first ones, in order
    assert sent["recipients_truncated"] is True and sent["recipient_count"] == 200
    assert (sent["box_id"], sent["level"], data["event_id"], data["type"]) == ("d-1", 3, ev.event_id, payload.type)
    one_more = raw.replace(f'"{recipients[kept - 1]}"', f'"{recipients[kept - 1]}","{recipients[kept]}"')
    assert len(one_more.encode()) > MSG_BODY_MAX_BYTES  # as many as fit
    assert await publisher.steps.done(ev.event_id) == {MESSAGE}


@pytest.mark.parametrize(
    "payload",
    [
        e.RoomUserJoined(user_id="j" * 13_000, role="member"),
        e.RoomUserKicked(operator_id="o" * 13_000, target_id="carol", ban_seconds=60, banned_until_ms=1),
    ],
    ids=lambda p: p.type,
)
async def test_any_other_event_too_large_for_one_message_fails_for_good_before_calling_im(
    publisher: TencentImPublisher, sandbox: RunningSandbox, payload: e.EventPayload
) -> None:
    await room_with_group(publisher)
    ev = event(payload, 4)
    before = counts(sandbox)
    with pytest.raises(MessageTooLarge, match=f"over the {MSG_BODY_MAX_BYTES} bytes") as err:
        await publish(publisher, ev)
    assert isinstance(err.value, PermanentError)
    assert since(sandbox, before) == {}  # nothing sent: not the message, not the kick's ban
    assert await publisher.steps.done(ev.event_id) == set()


async def test_publishing_the_same_event_twice_sends_once(
    publisher: TencentImPublisher, sandbox: RunningSandbox
) -> None:
    await room_with_group(publisher)
    ev = joined()
    assert await delta(sandbox, publish(publisher, ev)) == {"send_group_msg": 1}
    assert await delta(sandbox, publish(publisher, ev)) == {}  # our record: no request at all
    assert len(sandbox.state.messages(group_of())) == 1


async def test_concurrent_duplicates_make_one_message(publisher: TencentImPublisher, sandbox: RunningSandbox) -> None:
    """Two workers holding the same row (an expired lease) race: Tencent's window absorbs one."""
    await room_with_group(publisher)
    ev = joined()
    await asyncio.gather(publish(publisher, ev), publish(publisher, ev))
    assert len(sandbox.state.messages(group_of())) == 1
    assert await publisher.steps.done(ev.event_id) == {MESSAGE}


async def test_a_repair_sent_inside_the_window_is_absorbed_as_its_original(
    publisher: TencentImPublisher, sandbox: RunningSandbox, database: Database
) -> None:
    """A repair re-sends an event under a new event_id and names the original (repair_of); its steps are
    recorded under the original's id, and its message's Random must be the original's too, or Tencent takes
    it for a new message when the original's send went out unrecorded (found by review)."""
    await room_with_group(publisher)
    ev = joined()
    await publish(publisher, ev)
    await wipe_steps(database)  # the original's send reached IM; its record did not survive
    repair = e.Event(uuid.uuid4().hex, ev.app_code, ev.room_id, ev.room_version, ev.occurred_at_ms, ev.payload,
                     repair_of=ev.event_id)
    sandbox.state.advance_clock(10)
    assert await delta(sandbox, publish(publisher, repair)) == {"send_group_msg": 1}
    group = sandbox.state.group(group_of())
    assert group is not None and group.duplicates_absorbed == 1
    assert len(sandbox.state.messages(group_of())) == 1


async def test_a_repair_past_the_window_names_its_original_so_clients_can_drop_it(
    publisher: TencentImPublisher, sandbox: RunningSandbox, database: Database
) -> None:
    """Past Tencent's window nothing absorbs a repair whose original went out unrecorded: clients get it
    twice, and can only tell it is the same event if its Data names the original's event_id, as the
    original's did (it named the repair's own id before; found by review)."""
    await room_with_group(publisher)
    ev = joined()
    await publish(publisher, ev)
    await wipe_steps(database)
    sandbox.state.advance_clock(301)
    repair = e.Event(uuid.uuid4().hex, ev.app_code, ev.room_id, ev.room_version, ev.occurred_at_ms, ev.payload,
                     repair_of=ev.event_id)
    await publish(publisher, repair)
    first, second = custom_data(sandbox)
    assert first["event_id"] == second["event_id"] == ev.event_id
    assert first == second  # the same event to a client, whichever of the two it keeps


async def test_tencent_window_absorbs_quick_resends_and_our_record_covers_the_rest(
    publisher: TencentImPublisher, sandbox: RunningSandbox, database: Database
) -> None:
    await room_with_group(publisher)
    ev = joined()
    await publish(publisher, ev)

    # record lost, within 5 minutes: the client really sends again, Tencent drops it (same Random)
    await wipe_steps(database)
    sandbox.state.advance_clock(200)
    assert await delta(sandbox, publish(publisher, ev)) == {"send_group_msg": 1}
    group = sandbox.state.group(group_of())
    assert group is not None and group.duplicates_absorbed == 1
    assert len(sandbox.state.messages(group_of())) == 1

    # past the window, record kept: our own record alone prevents the duplicate, no request at all
    sandbox.state.advance_clock(301)
    assert await delta(sandbox, publish(publisher, ev)) == {}
    assert len(sandbox.state.messages(group_of())) == 1

    # past the window AND record lost: Tencent alone takes it for a new message — why the record matters
    await wipe_steps(database)
    assert await delta(sandbox, publish(publisher, ev)) == {"send_group_msg": 1}
    assert [m.random for m in sandbox.state.messages(group_of())] == [random_for(ev.event_id)] * 2


async def test_message_to_a_group_not_created_yet_is_retryable(
    publisher: TencentImPublisher, sandbox: RunningSandbox
) -> None:
    ev = joined()
    with pytest.raises(RetryableError, match="10010"):
        await publish(publisher, ev)
    assert await publisher.steps.done(ev.event_id) == set()
    await room_with_group(publisher)  # the RoomCreated row catches up
    await publish(publisher, ev)
    assert [m["event_id"] for m in custom_data(sandbox)] == [ev.event_id]


async def test_message_to_a_group_we_destroyed_is_dropped(
    publisher: TencentImPublisher, sandbox: RunningSandbox
) -> None:
    await room_with_group(publisher)
    await publish(publisher, closed())
    late = joined(version=3)  # an older row retried after RoomClosed was delivered
    await publish(publisher, late)
    assert errors_of(sandbox, "send_group_msg") == [0, 10010]  # the RoomClosed message, then the refused late one
    assert [m["type"] for m in custom_data(sandbox)] == ["RoomClosed"]
    assert await publisher.steps.done(late.event_id) == {MESSAGE}  # done: never retried again
    assert await delta(sandbox, publish(publisher, late)) == {}


# --------------------------------------------------------------------------- RoomUserKicked -> membership control


async def test_kick_on_avchatroom_bans(publisher: TencentImPublisher, sandbox: RunningSandbox) -> None:
    await room_with_group(publisher)
    ev = kicked(ban_seconds=900)
    made = await delta(sandbox, publish(publisher, ev))
    assert made == {"ban_group_member": 1, "send_group_msg": 1}
    assert [r.command for r in sandbox.state.requests][-2:] == ["ban_group_member", "send_group_msg"]
    group = sandbox.state.group(group_of())
    assert group is not None
    assert 890 < group.banned["carol"] - sandbox.state.now() <= 900
    assert "carol" not in group.muted
    assert [m["type"] for m in custom_data(sandbox)] == ["RoomUserKicked"]
    assert await publisher.steps.done(ev.event_id) == {MEMBER, MESSAGE}


async def test_kick_on_avchatroom_without_bans_mutes_for_the_ban(
    publisher: TencentImPublisher, sandbox: RunningSandbox
) -> None:
    await room_with_group(publisher)
    sandbox.state.ban_enabled = False  # the package lacks ban_group_member: 10059
    made = await delta(sandbox, publish(publisher, kicked(ban_seconds=120)))
    assert made == {"ban_group_member": 1, "forbid_send_msg": 1, "send_group_msg": 1}
    assert errors_of(sandbox, "ban_group_member") == [10059]
    group = sandbox.state.group(group_of())
    assert group is not None and "carol" not in group.banned
    assert 110 < group.muted["carol"] - sandbox.state.now() <= 120


async def test_kick_on_public_group_deletes_the_member(
    make_publisher: Make, client: TencentImClient, sandbox: RunningSandbox
) -> None:
    pub = make_publisher(PUBLIC)
    group_id = await room_with_group(pub)
    await client.multiaccount_import(["bob", "carol"])
    assert await client.add_group_member(group_id, ["bob", "carol"]) == {"bob": 1, "carol": 1}
    made = await delta(sandbox, publish(pub, kicked()))
    assert made == {"delete_group_member": 1, "send_group_msg": 1}
    group = sandbox.state.group(group_id)
    assert group is not None and set(group.members) == {OWNER, "bob"}
    assert [m["type"] for m in custom_data(sandbox, PUBLIC)] == ["RoomUserKicked"]


@pytest.mark.parametrize(("group_type", "command"), [(PUBLIC, "delete_group_member"), (AV, "ban_group_member")])
async def test_kicking_a_user_never_imported_counts_as_done(
    make_publisher: Make, sandbox: RunningSandbox, group_type: str, command: str
) -> None:
    pub = make_publisher(group_type)
    await room_with_group(pub)
    sandbox.state.inject_error(command, 10019, "UserID never imported", count=1)
    ev = kicked("ghost")
    await publish(pub, ev)
    assert errors_of(sandbox, command) == [10019]
    assert await pub.steps.done(ev.event_id) == {MEMBER, MESSAGE}
    assert [m["type"] for m in custom_data(sandbox, group_type)] == ["RoomUserKicked"]


async def test_kick_retry_after_partial_failure_resends_only_the_message(
    make_publisher: Make, client: TencentImClient, sandbox: RunningSandbox
) -> None:
    pub = make_publisher(PUBLIC)
    group_id = await room_with_group(pub)
    await client.account_import("carol")
    await client.add_group_member(group_id, ["carol"])
    sandbox.state.inject_error("send_group_msg", 10002, "internal error, retry", count=1)
    ev = kicked()
    before = counts(sandbox)
    with pytest.raises(RetryableError):
        await publish(pub, ev)
    assert since(sandbox, before) == {"delete_group_member": 1, "send_group_msg": 1}
    assert await pub.steps.done(ev.event_id) == {MEMBER}
    assert await delta(sandbox, publish(pub, ev)) == {"send_group_msg": 1}  # the member step is not repeated
    assert await pub.steps.done(ev.event_id) == {MEMBER, MESSAGE}
    assert [m["type"] for m in custom_data(sandbox, PUBLIC)] == ["RoomUserKicked"]


async def test_kick_retry_after_member_step_failed_redoes_both(
    publisher: TencentImPublisher, sandbox: RunningSandbox
) -> None:
    await room_with_group(publisher)
    sandbox.state.inject_error("ban_group_member", 10002, "internal error, retry", count=1)
    ev = kicked()
    before = counts(sandbox)
    with pytest.raises(RetryableError):
        await publish(publisher, ev)
    assert since(sandbox, before) == {"ban_group_member": 1}  # no message before the member is out
    assert await delta(sandbox, publish(publisher, ev)) == {"ban_group_member": 1, "send_group_msg": 1}


async def test_kick_before_the_group_exists_is_retryable(publisher: TencentImPublisher) -> None:
    with pytest.raises(RetryableError):
        await publish(publisher, kicked())


async def test_kick_after_we_destroyed_the_group_counts_as_done(
    publisher: TencentImPublisher, sandbox: RunningSandbox
) -> None:
    await room_with_group(publisher)
    await publish(publisher, closed())
    before = sandbox.state.request_counts()
    await publish(publisher, kicked(version=5))  # nobody left to remove, nobody to tell
    assert sandbox.state.request_counts()["ban_group_member"] == before.get("ban_group_member", 0) + 1


# --------------------------------------------------------------------------- RoomClosed -> message, then destroy


async def test_room_closed_sends_the_message_then_destroys(
    publisher: TencentImPublisher, sandbox: RunningSandbox
) -> None:
    await room_with_group(publisher)
    ev = closed()
    assert await delta(sandbox, publish(publisher, ev)) == {"send_group_msg": 1, "destroy_group": 1}
    assert [r.command for r in sandbox.state.requests][-2:] == ["send_group_msg", "destroy_group"]
    assert group_of() not in sandbox.state.groups
    group = sandbox.state.group(group_of())
    assert group is not None and group.destroyed_at is not None
    assert [m["type"] for m in custom_data(sandbox)] == ["RoomClosed"]
    assert await publisher.steps.done(ev.event_id) == {MESSAGE, DESTROY}
    assert await publisher.steps.destroyed(group_of())
    assert await delta(sandbox, publish(publisher, ev)) == {}


async def test_room_closed_retry_destroys_only_and_a_missing_group_counts_as_done(
    publisher: TencentImPublisher, client: TencentImClient, sandbox: RunningSandbox
) -> None:
    await room_with_group(publisher)
    sandbox.state.inject_error("destroy_group", 60008, "service timeout", count=1)
    ev = closed()
    with pytest.raises(RetryableError):
        await publish(publisher, ev)
    assert await publisher.steps.done(ev.event_id) == {MESSAGE}
    await client.destroy_group(group_of())  # gone meanwhile (an operator, or an earlier attempt's late success)
    assert await delta(sandbox, publish(publisher, ev)) == {"destroy_group": 1}  # no second message
    assert errors_of(sandbox, "destroy_group") == [60008, 0, 10010]
    assert await publisher.steps.done(ev.event_id) == {MESSAGE, DESTROY}
    assert len(sandbox.state.messages(group_of())) == 1


async def test_destroy_answering_group_not_found_counts_as_done(
    publisher: TencentImPublisher, sandbox: RunningSandbox
) -> None:
    await room_with_group(publisher)
    sandbox.state.inject_error("destroy_group", 10015, "group id not found", count=1)
    ev = closed()
    await publish(publisher, ev)
    assert await publisher.steps.done(ev.event_id) == {MESSAGE, DESTROY}


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("mode", ["http_503", "reset"])
async def test_outage_is_retryable_and_recovers(
    publisher: TencentImPublisher, sandbox: RunningSandbox, mode: OutageMode
) -> None:
    await room_with_group(publisher)
    sandbox.state.set_outage(mode)
    ev = joined()
    with pytest.raises(RetryableError):
        await publish(publisher, ev)
    assert await publisher.steps.done(ev.event_id) == set()
    sandbox.state.set_outage(None)
    await publish(publisher, ev)
    assert [m["event_id"] for m in custom_data(sandbox)] == [ev.event_id]


async def test_outage_during_room_created_is_retryable(publisher: TencentImPublisher, sandbox: RunningSandbox) -> None:
    sandbox.state.set_outage("http_503")
    with pytest.raises(RetryableError):
        await publish(publisher, created())


async def test_injected_10004_on_send_is_permanent(publisher: TencentImPublisher, sandbox: RunningSandbox) -> None:
    await room_with_group(publisher)
    sandbox.state.inject_error("send_group_msg", 10004, "invalid parameter", count=1)
    ev = joined()
    with pytest.raises(PermanentError, match="10004"):
        await publish(publisher, ev)
    assert await publisher.steps.done(ev.event_id) == set()


async def test_usersig_expiry_is_cured_by_one_refresh(
    publisher: TencentImPublisher, client: TencentImClient, sandbox: RunningSandbox
) -> None:
    await room_with_group(publisher)
    assert client.usersig_generations == 1
    sandbox.state.force_usersig_expiry(1)
    assert await delta(sandbox, publish(publisher, joined())) == {"send_group_msg": 2}
    assert errors_of(sandbox, "send_group_msg") == [70001, 0]
    assert client.usersig_generations == 2
    assert len(sandbox.state.messages(group_of())) == 1


async def test_slow_im_is_bounded_by_the_deadline(publisher: TencentImPublisher, sandbox: RunningSandbox) -> None:
    await room_with_group(publisher)
    sandbox.state.set_latency(3.0, "send_group_msg")
    started = time.monotonic()
    with pytest.raises(RetryableError):
        await publish(publisher, joined(), timeout_s=0.3)
    assert time.monotonic() - started < 1.5


async def test_a_late_room_created_retry_does_not_bring_a_destroyed_group_back(
    publisher: TencentImPublisher, sandbox: RunningSandbox
) -> None:
    await room_with_group(publisher)  # CreateRoom's synchronous path made the group
    await publish(publisher, closed())  # the room closed: message, then destroy
    group = group_id_for(APP, ROOM)
    assert group not in sandbox.state.groups
    await publish(publisher, created())  # the RoomCreated row's retry arrives last
    assert group not in sandbox.state.groups


async def test_a_late_room_created_of_a_closed_room_makes_no_group_once_the_destroy_record_is_forgotten(
    publisher: TencentImPublisher, sandbox: RunningSandbox, database: Database
) -> None:
    """consumers.dedup_retention forgets the destroy record with the others; room_meta still says closed."""
    await store_room(database)
    await room_with_group(publisher)
    await close_in_store(database)
    await publish(publisher, closed())
    assert group_id_for(APP, ROOM) not in sandbox.state.groups
    async with database.write() as conn:
        await conn.execute(sa.delete(t.im_sent_event))  # every record forgotten, the destroy's included
    group = group_id_for(APP, ROOM)
    ev = created()
    assert await publisher.already_sent(ev)  # the IM bridge acknowledges it as a duplicate
    await publish(publisher, ev)
    assert group not in sandbox.state.groups


# --------------------------------------------------------------------------- the work done, its answer lost


async def answer_lost_then_retried(
    publisher: TencentImPublisher, sandbox: RunningSandbox, command: str, ev: e.Event
) -> None:
    """Tencent applies ``command`` and its answer never arrives (503): the row fails, then is retried."""
    sandbox.state.lose_answers(command)
    with pytest.raises(RetryableError):
        await publish(publisher, ev)
    assert sandbox.state.lost_answers == {}  # the loss struck
    await publish(publisher, ev)


@pytest.mark.parametrize("owned_answers_10021", [False, True])
async def test_a_group_created_whose_answer_was_lost_is_taken_as_ours_on_the_retry(
    publisher: TencentImPublisher, sandbox: RunningSandbox, owned_answers_10021: bool
) -> None:
    """Tencent made the group and its answer never came: the retry finds the id used (10025, or 10021)."""
    sandbox.state.owned_group_answers_10021 = owned_answers_10021
    ev = created()
    await answer_lost_then_retried(publisher, sandbox, "create_group", ev)
    assert await publisher.steps.done(ev.event_id) == {GROUP}
    assert sandbox.state.groups[group_of()].owner == OWNER


async def test_a_message_sent_whose_answer_was_lost_is_stored_once_after_the_retry(
    publisher: TencentImPublisher, sandbox: RunningSandbox
) -> None:
    await room_with_group(publisher)
    ev = joined()
    await answer_lost_then_retried(publisher, sandbox, "send_group_msg", ev)  # the same Random: a duplicate
    assert len(sandbox.state.messages(group_of())) == 1
    assert await publisher.steps.done(ev.event_id) == {MESSAGE}


async def test_a_group_destroyed_whose_answer_was_lost_counts_as_destroyed_on_the_retry(
    publisher: TencentImPublisher, sandbox: RunningSandbox
) -> None:
    await room_with_group(publisher)
    ev = closed()
    await answer_lost_then_retried(publisher, sandbox, "destroy_group", ev)  # then "group not found": done
    assert group_of() not in sandbox.state.groups
    assert await publisher.steps.done(ev.event_id) == {MESSAGE, DESTROY}


# --------------------------------------------------------------------------- a missing group is ensured again


async def store_room(db: Database, *, status: str = "open", owner: str = OWNER, title: str = "Room one") -> None:
    """The room's ``room_meta`` row, as the write path leaves it (only owner, title and status matter)."""
    now = now_ms()
    async with db.write() as conn:
        await conn.execute(
            sa.insert(t.room_meta).values(
                app_code=APP, room_id=ROOM, version=3, lease_epoch=1, owner_id=owner, title=title, status=status,
                seat_count=8, member_count=1, heat=0, created_at_ms=now, updated_at_ms=now,
            )
        )  # fmt: skip


async def close_in_store(db: Database) -> None:
    async with db.write() as conn:
        await conn.execute(sa.update(t.room_meta).values(status="closed"))


def commands_since(sandbox: RunningSandbox, before: int) -> list[tuple[str, int]]:
    return [(r.command, r.error_code) for r in sandbox.state.requests[before:]]


async def test_a_group_dismissed_by_im_is_ensured_again_for_an_open_room_then_the_message_sent(
    publisher: TencentImPublisher, sandbox: RunningSandbox, database: Database
) -> None:
    await store_room(database, title="Friday night")
    await room_with_group(publisher)
    sandbox.state.dismiss_group(group_of())  # Tencent dismissed it (console, idle AVChatRoom, lost state...)
    ev = joined()
    before = len(sandbox.state.requests)
    await publish(publisher, ev)
    assert commands_since(sandbox, before) == [
        ("send_group_msg", 10010),
        ("account_import", 0),  # the owner, as RoomCreated's EnsureGroup does
        ("create_group", 0),
        ("send_group_msg", 0),
    ]
    group = sandbox.state.groups[group_of()]
    assert (group.type, group.owner, group.name) == (AV, OWNER, "Friday night")
    assert [m["event_id"] for m in custom_data(sandbox)] == [ev.event_id]
    assert await publisher.steps.done(ev.event_id) == {MESSAGE}
    assert await delta(sandbox, publish(publisher, ev)) == {}


async def test_a_group_lost_by_a_restarted_im_is_ensured_again_for_a_kick(
    publisher: TencentImPublisher, sandbox: RunningSandbox, database: Database
) -> None:
    await store_room(database)
    sandbox.state.reset()  # an IM that forgot everything: no group, no accounts
    ev = kicked(target="carol", ban_seconds=900)
    before = len(sandbox.state.requests)
    await publish(publisher, ev)
    assert commands_since(sandbox, before) == [
        ("ban_group_member", 10010),
        ("account_import", 0),
        ("create_group", 0),
        ("ban_group_member", 0),  # the ban matters in a new group too: carol cannot come back for 900 s
        ("send_group_msg", 0),
    ]
    assert sandbox.state.groups[group_of()].banned.keys() == {account_id_for("carol")}
    assert await publisher.steps.done(ev.event_id) == {MEMBER, MESSAGE}


async def test_a_room_closed_in_the_store_does_not_get_its_group_back(
    publisher: TencentImPublisher, sandbox: RunningSandbox, database: Database
) -> None:
    await store_room(database)
    await room_with_group(publisher)
    await close_in_store(database)  # RoomClosed committed, its row not delivered yet
    sandbox.state.dismiss_group(group_of())
    late = joined()
    before = len(sandbox.state.requests)
    await publish(publisher, late)
    assert commands_since(sandbox, before) == [("send_group_msg", 10010)]  # no create_group
    assert await publisher.steps.done(late.event_id) == {MESSAGE}  # done: nobody to tell
    ev = closed()
    await publish(publisher, ev)  # RoomClosed itself: the group is gone already, which is what it wanted
    assert group_of() not in sandbox.state.groups
    assert await publisher.steps.done(ev.event_id) == {MESSAGE, DESTROY}


async def test_a_group_we_destroyed_is_not_ensured_again_even_if_the_store_says_open(
    publisher: TencentImPublisher, sandbox: RunningSandbox, database: Database
) -> None:
    await store_room(database)  # e.g. the room_meta row of a room id reused after a close
    await room_with_group(publisher)
    await publish(publisher, closed())
    before = len(sandbox.state.requests)
    await publish(publisher, joined(version=3))
    assert commands_since(sandbox, before) == [("send_group_msg", 10010)]
    assert group_of() not in sandbox.state.groups


async def test_a_group_still_missing_after_ensuring_it_is_retryable(
    publisher: TencentImPublisher, sandbox: RunningSandbox, database: Database
) -> None:
    await store_room(database)
    sandbox.state.inject_error("send_group_msg", 10010, "group does not exist", count=2)
    ev = joined()
    with pytest.raises(RetryableError, match="10010"):
        await publish(publisher, ev)
    assert errors_of(sandbox, "create_group") == [0]  # ensured once, not in a loop
    assert await publisher.steps.done(ev.event_id) == set()
    await publish(publisher, ev)  # the next attempt finds the group
    assert [m["event_id"] for m in custom_data(sandbox)] == [ev.event_id]


async def test_a_group_id_taken_by_someone_else_meanwhile_stays_permanent(
    publisher: TencentImPublisher, client: TencentImClient, sandbox: RunningSandbox, database: Database
) -> None:
    await store_room(database)
    sandbox.state.inject_error("send_group_msg", 10015, "group id invalid", count=1)
    await client.account_import("mallory")
    await client.create_group(group_of(), "mallory", "Not yours", AV)
    with pytest.raises(PermanentError, match="10021"):
        await publish(publisher, joined())


async def test_sent_record_lookups_that_arrive_together_share_one_read(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = count_calls(monkeypatch, database, "run_read")
    steps = SentSteps(database, clock=now_ms)  # the IM bridge's deliveries of one fetch look up together
    first, second, never = (uuid.uuid4().hex for _ in range(3))
    for event_id, step in ((first, MEMBER), (first, MESSAGE), (second, GROUP)):
        await steps.record(event_id, "g", step)
    before = reads.count
    done = await asyncio.gather(*(steps.done(event_id) for event_id in (first, second, never, first)))
    assert done == [{MEMBER, MESSAGE}, {GROUP}, set(), {MEMBER, MESSAGE}]
    assert reads.count == before + 1
    done[0].add(DESTROY)  # each caller gets a set of its own
    assert done[3] == {MEMBER, MESSAGE}


async def test_a_record_waits_for_those_of_the_other_publishes_under_way_and_they_share_a_write(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = count_calls(monkeypatch, database, "run_write")
    steps = SentSteps(database, clock=now_ms, record_linger_s=30)
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    with steps.under_way(), steps.under_way():  # two publishes under way
        early = asyncio.create_task(steps.record(first, "g", MESSAGE))
        await asyncio.sleep(0)
        assert not early.done()  # held for the other publish's record
        await steps.record(second, "g", MESSAGE)
        await early
    assert writes.count == 1
    assert await asyncio.gather(steps.done(first), steps.done(second)) == [{MESSAGE}, {MESSAGE}]
    await steps.record(uuid.uuid4().hex, "g", GROUP)  # nobody else under way: at once
    assert writes.count == 2
