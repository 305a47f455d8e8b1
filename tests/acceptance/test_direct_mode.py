"""SPEC §9 in direct mode, automated: MariaDB, the real outbox worker, the IM sandbox and the
reference activity service, wired exactly as the embedded default wires them."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from tests.acceptance.conftest import all_delivered, eventually, statuses

from roomservice.activity.service import start_activity_service
from roomservice.activity.store import ActivityStore
from roomservice.admin.operations import OutboxFilter
from roomservice.bootstrap import Process
from roomservice.clock import wall_clock_ms
from roomservice.domain import commands as c
from roomservice.domain.state import utc_day
from roomservice.integrations.tencent_im.client import group_id_for
from roomservice.store import tables as t

pytestmark = pytest.mark.slow

APP, ROOM = "demo", "r1"


async def run(rt: Process, command_id: str, command: c.Command, room: str = ROOM) -> dict[str, object]:
    return await rt.service.execute(APP, room, command_id, command)


async def real_chain(rt: Process, room: str = ROOM) -> list[str]:
    """create -> join -> mic -> gift -> leave -> kick; returns every event type committed."""
    bodies = [
        await run(rt, f"{room}-1", c.CreateRoom(owner_id="alice", title="Chain"), room),
        await run(rt, f"{room}-2", c.JoinRoom(user_id="bob"), room),
        await run(rt, f"{room}-3", c.JoinRoom(user_id="carol"), room),
        await run(rt, f"{room}-4", c.TakeMic(user_id="bob", seat=1), room),
        await run(rt, f"{room}-5", c.SendGift(sender_id="bob", receiver_id="alice", gift_id="rose", count=3), room),
        await run(rt, f"{room}-6", c.LeaveRoom(user_id="bob"), room),
        await run(rt, f"{room}-7", c.KickUser(operator_id="alice", target_id="carol"), room),
    ]
    return [e["type"] for b in bodies for e in b["events"]]  # type: ignore[index, union-attr]


def im_messages(rt: Process, room: str = ROOM) -> list[dict[str, object]]:
    assert rt.sandbox is not None
    group = group_id_for(APP, room, group_type=rt.settings.tencent_im.group_type)
    return [json.loads(m.data or "{}") for m in rt.sandbox.state.messages(group)]


async def force_redelivery(rt: Process, *, forget_im_record: bool) -> None:
    """Every row pending again; optionally wipe our own IM sent-record so the client really
    sends again and Tencent's duplicate window (same Random) has to absorb it."""
    async with rt.db.write() as conn:
        await conn.execute(sa.update(t.room_outbox).values(status="pending", targets_done="", delivered_at_ms=None))
        if forget_im_record:
            await conn.execute(sa.delete(t.im_sent_event))
    assert rt.worker is not None
    rt.worker.wake()
    await eventually(lambda: all_delivered(rt), what="re-delivery")


async def test_normal_delivery_reaches_im_and_activity_once_even_when_resent(direct: Process) -> None:
    types = await real_chain(direct)
    await eventually(lambda: all_delivered(direct), what="every row delivered")
    sandbox = direct.sandbox
    assert sandbox is not None
    group = sandbox.state.group(group_id_for(APP, ROOM, group_type="AVChatRoom"))
    assert group is not None and group.owner == "alice"
    sent = im_messages(direct)
    assert sorted(m["type"] for m in sent) == sorted(t_ for t_ in types if t_ != "RoomCreated")
    assert [m["room_version"] for m in sent] == sorted(m["room_version"] for m in sent)  # in room order
    assert all({"event_id", "type", "room_version", "payload"} <= set(m) for m in sent)
    assert "carol" in group.banned  # AVChatRoom: the kicked user is banned from the group
    store = ActivityStore(direct.db)
    day = utc_day(wall_clock_ms())
    board = await store.gift_leaderboard(APP, ROOM, day=day, board="received", limit=10)
    assert [(b.user_id, b.value) for b in board] == [("alice", 30)]
    calls = sandbox.state.request_counts()

    await force_redelivery(direct, forget_im_record=False)
    assert sandbox.state.request_counts() == calls  # our record: IM is not even called again
    await force_redelivery(direct, forget_im_record=True)
    assert len(im_messages(direct)) == len(sent)  # sent again, absorbed by Tencent's Random window
    assert group.duplicates_absorbed == len(sent)
    again = await store.gift_leaderboard(APP, ROOM, day=day, board="received", limit=10)
    assert [(b.user_id, b.value) for b in again] == [("alice", 30)]  # no duplicate activity effect

    await run(direct, "close", c.CloseRoom(operator_id="alice"))
    await eventually(lambda: all_delivered(direct), what="close delivered")
    assert group.destroyed_at is not None
    assert im_messages(direct)[-1]["type"] == "RoomClosed"  # the message went out before the destroy


async def test_im_down_commands_succeed_rows_fail_then_replay_delivers(direct: Process) -> None:
    assert direct.sandbox is not None
    direct.sandbox.state.set_outage("http_503")
    await run(direct, "c1", c.CreateRoom(owner_id="alice", title="Down"))  # commands still succeed
    await run(direct, "c2", c.JoinRoom(user_id="bob"))

    async def dead_letters() -> bool:
        return (await statuses(direct)).get("failed", 0) == 2

    await eventually(dead_letters, what="rows to become dead letters after max_retry_count")
    async with direct.db.read() as conn:
        rows = (await conn.execute(sa.select(t.room_outbox))).all()
    assert all(r.retry_count == 3 and "im" not in r.targets_done.split(",") for r in rows)
    assert all("activity" in r.targets_done.split(",") for r in rows)  # activity got them once

    direct.sandbox.state.set_outage(None)
    report = await direct.outbox_admin.replay_matching(OutboxFilter(statuses=("failed",)), actor="test")
    assert report.replayed == 2
    await eventually(lambda: all_delivered(direct), what="replayed rows delivered")
    assert [m["type"] for m in im_messages(direct)] == ["RoomUserJoined"]
    assert direct.sandbox.state.group(group_id_for(APP, ROOM)) is not None


async def test_activity_down_rows_retry_and_deliver_when_it_is_back(direct: Process) -> None:
    service = direct.activity_service
    assert service is not None
    port = service.port
    await service.stop()
    await run(direct, "c1", c.CreateRoom(owner_id="alice", title="x"))
    await run(direct, "c2", c.JoinRoom(user_id="bob"))

    async def retrying() -> bool:
        async with direct.db.read() as conn:
            rows = (await conn.execute(sa.select(t.room_outbox))).all()
        return all(r.status in ("retryable", "delivering") and r.retry_count >= 1 for r in rows)

    await eventually(retrying, what="rows retrying while activity is down")
    revived = await start_activity_service(direct.db, port=port)
    try:
        await eventually(lambda: all_delivered(direct), what="delivery once activity is back")
        assert await ActivityStore(direct.db).is_processed(
            (await _event_ids(direct, "RoomUserJoined"))[0]
        )
    finally:
        await revived.stop()


async def test_usersig_expiry_is_cured_by_a_fresh_signature(direct: Process) -> None:
    assert direct.sandbox is not None
    await run(direct, "c1", c.CreateRoom(owner_id="alice", title="x"))
    await eventually(lambda: all_delivered(direct))
    direct.sandbox.state.force_usersig_expiry(1)  # the next call answers 70001
    await run(direct, "c2", c.JoinRoom(user_id="bob"))
    await eventually(lambda: all_delivered(direct), what="delivery after a 70001")
    codes = [r.error_code for r in direct.sandbox.state.requests if r.command == "send_group_msg"]
    assert codes == [70001, 0]
    async with direct.db.read() as conn:
        query = sa.select(t.room_outbox).where(t.room_outbox.c.event_type == "RoomUserJoined")
        joined = (await conn.execute(query)).one()
    assert joined.retry_count == 0  # cured inside one attempt


async def _event_ids(rt: Process, event_type: str) -> list[str]:
    async with rt.db.read() as conn:
        rows = await conn.execute(sa.select(t.room_outbox.c.event_id).where(t.room_outbox.c.event_type == event_type))
        return [eid for (eid,) in rows.all()]
