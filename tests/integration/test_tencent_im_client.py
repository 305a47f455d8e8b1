"""The real Tencent IM client against the IM sandbox, over loopback HTTP and over the
in-process transport the embedded mode uses (every test runs both ways: same answers, same
faults, same error classification).

Covers every operation's happy path, the classification of each error family, the
UserSig cache and refresh, the client-side rate limit (token bucket with a fake clock,
plus a lower bound on request spacing seen by the sandbox) and Tencent's duplicate
``Random`` window (with the sandbox clock moved, not waited for).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from pydantic import SecretStr

from roomservice.config import TencentIMConfig
from roomservice.integrations.im_sandbox import RunningSandbox, running_sandbox
from roomservice.integrations.im_sandbox.state import MSG_BODY_MAX_BYTES as SANDBOX_MSG_BODY_MAX_BYTES
from roomservice.integrations.tencent_im import (
    GROUP_NOT_FOUND_CODES,
    ImPermanentError,
    ImRetryableError,
    ImSignatureError,
    RateLimiter,
    RateLimitExceeded,
    TencentImClient,
    TokenBucket,
    account_id_for,
    group_id_for,
    random_for,
)
from roomservice.integrations.tencent_im.client import MSG_BODY_MAX_BYTES
from roomservice.integrations.tencent_im.errors import RETRYABLE_CODES

APP = 1_400_000_001
KEY = "sandbox-secret-key"
ADMIN = "administrator"


class _ReachedInProcess(RunningSandbox):
    """The same running sandbox, reached by its clients without a socket."""

    def transport(self) -> httpx.AsyncBaseTransport:
        return self.in_process_transport()


@pytest_asyncio.fixture(params=["tcp", "in-process"])
async def sandbox(request: pytest.FixtureRequest) -> AsyncIterator[RunningSandbox]:
    async with running_sandbox(APP, KEY) as running:
        if request.param == "tcp":
            yield running
        else:
            yield _ReachedInProcess(running.state, running.host, running.port, running.uds)


def make_client(sandbox: RunningSandbox, **overrides: Any) -> TencentImClient:
    options: dict[str, Any] = {
        "base_url": sandbox.base_url,
        "sdk_app_id": APP,
        "admin_identifier": ADMIN,
        "secret_key": KEY,
        "request_timeout": 5.0,
        "transport": sandbox.transport(),
    }
    options.update(overrides)
    return TencentImClient(**options)


@pytest_asyncio.fixture
async def client(sandbox: RunningSandbox) -> AsyncIterator[TencentImClient]:
    async with make_client(sandbox) as im:
        yield im


async def room_group(im: TencentImClient, room: str = "r1", *, group_type: str = "AVChatRoom") -> str:
    await im.account_import("owner")
    return await im.create_group(group_id_for("app", room, group_type=group_type), "owner", "Room", group_type)


# --------------------------------------------------------------------------- happy paths


async def test_account_import_and_multiaccount_import(client: TencentImClient, sandbox: RunningSandbox) -> None:
    await client.account_import("alice", "Alice")
    await client.account_import("alice", "Alice again")  # importing twice is fine
    failed = await client.multiaccount_import(["bob", "carol", "x" * 33, "bob"])
    assert failed == ["x" * 33]
    assert set(sandbox.state.accounts) == {"alice", "bob", "carol"}
    assert sandbox.state.accounts["alice"].nick == "Alice again"


async def test_multiaccount_import_chunks_by_100(client: TencentImClient, sandbox: RunningSandbox) -> None:
    assert await client.multiaccount_import([f"u{i}" for i in range(250)]) == []
    assert len(sandbox.state.accounts) == 250
    assert sandbox.state.request_counts()["multiaccount_import"] == 3


async def test_create_group_and_get_group_info(client: TencentImClient, sandbox: RunningSandbox) -> None:
    group_id = await room_group(client)
    assert group_id == "room_app-r1"
    found, missing = await client.get_group_info([group_id, "room_app-nope"])
    assert found.found and found.type == "AVChatRoom" and found.owner_account == "owner" and found.name == "Room"
    assert not missing.found and missing.error_code in GROUP_NOT_FOUND_CODES
    group = sandbox.state.group(group_id)
    assert group is not None and group.owner == "owner" and group.members == {}  # AVChatRoom: join via SDK


async def test_get_group_info_with_a_response_filter(client: TencentImClient, sandbox: RunningSandbox) -> None:
    group_id = await room_group(client, group_type="Public")  # a group with a member list
    found, missing = await client.get_group_info([group_id, "room_app-nope"], base_fields=("Type", "Owner_Account"))
    assert (found.type, found.owner_account) == ("Public", "owner")
    assert set(found.raw) == {"GroupId", "ErrorCode", "ErrorInfo", "Type", "Owner_Account"}  # no name, no members
    assert found.name is None and found.members == () and found.member_num is None
    assert not missing.found and missing.error_code in GROUP_NOT_FOUND_CODES
    everything = (await client.get_group_info([group_id]))[0]  # no filter: all of it, members too
    assert everything.name == "Room" and everything.members == ("owner",) and everything.member_num == 1


async def test_group_name_is_cut_to_30_bytes(client: TencentImClient, sandbox: RunningSandbox) -> None:
    await client.account_import("owner")
    title = "语音房间" * 10  # 120 bytes of UTF-8
    group_id = await client.create_group("room_app-long", "owner", title, "AVChatRoom")
    group = sandbox.state.group(group_id)
    assert group is not None and group.name == "语音房间" * 2 + "语音"  # 30 bytes, whole characters


async def test_send_group_msg_custom_element(client: TencentImClient, sandbox: RunningSandbox) -> None:
    group_id = await room_group(client)
    await client.account_import("alice")
    data = json.dumps({"event_id": "e1", "type": "RoomUserJoined", "room_version": 2})
    first = await client.send_group_msg(group_id, data, random=random_for("e1"), desc="d", ext="x")
    second = await client.send_group_msg(group_id, "{}", random=random_for("e2"), from_account="alice")
    assert (first.msg_seq, second.msg_seq) == (1, 2)
    messages = sandbox.state.messages(group_id)
    assert [m.data for m in messages] == [data, "{}"]
    assert [m.from_account for m in messages] == [ADMIN, "alice"]
    assert messages[0].msg_body == [{"MsgType": "TIMCustomElem", "MsgContent": {"Data": data, "Desc": "d", "Ext": "x"}}]
    assert messages[0].random == random_for("e1")


async def test_a_message_body_over_12_kb_is_refused_for_good(client: TencentImClient, sandbox: RunningSandbox) -> None:
    assert MSG_BODY_MAX_BYTES == SANDBOX_MSG_BODY_MAX_BYTES == 12_288
    group_id = await room_group(client)
    await client.account_import("bob")
    fits = "语" * 4096  # 12,288 bytes of UTF-8: the most a message body may have
    await client.send_group_msg(group_id, fits, random=1)
    await client.send_c2c_msg("bob", fits, random=1)
    for data, desc in (("语" * 4096 + "x", ""), (fits, "d"), ("x" * 12_289, "")):  # Desc counts as Data does
        with pytest.raises(ImPermanentError) as err:
            await client.send_group_msg(group_id, data, random=2, desc=desc)
        assert err.value.code == 80002
        with pytest.raises(ImPermanentError) as err:
            await client.send_c2c_msg("bob", data, random=2, desc=desc)
        assert err.value.code == 93000
    assert [m.data for m in sandbox.state.messages(group_id)] == [fits]
    assert [m.data for m in sandbox.state.c2c_messages("bob")] == [fits]


async def test_send_group_msg_from_unimported_account_fails(client: TencentImClient) -> None:
    group_id = await room_group(client)
    with pytest.raises(ImPermanentError) as err:
        await client.send_group_msg(group_id, "{}", random=1, from_account="ghost")
    assert err.value.code == 10019


async def test_random_must_be_uint32(client: TencentImClient) -> None:
    with pytest.raises(ValueError, match="32-bit"):
        await client.send_group_msg("g", "{}", random=2**32)


async def test_duplicate_random_absorbed_within_five_minutes_only(
    client: TencentImClient, sandbox: RunningSandbox
) -> None:
    group_id = await room_group(client)
    random = random_for("event-1")
    first = await client.send_group_msg(group_id, "a", random=random)
    sandbox.state.advance_clock(299)
    again = await client.send_group_msg(group_id, "a", random=random)
    assert again == first
    assert len(sandbox.state.messages(group_id)) == 1
    other_sender = await client.send_group_msg(group_id, "a", random=random, from_account="owner")
    assert other_sender.msg_seq == 2  # the window is per sender
    sandbox.state.advance_clock(2)  # 301 s after the first send
    later = await client.send_group_msg(group_id, "a", random=random)
    assert later.msg_seq == 3
    assert [m.msg_seq for m in sandbox.state.messages(group_id)] == [1, 2, 3]


async def test_public_group_members(client: TencentImClient, sandbox: RunningSandbox) -> None:
    group_id = await room_group(client, group_type="Public")
    await client.multiaccount_import(["bob", "carol"])
    assert await client.add_group_member(group_id, ["bob", "owner"]) == {"bob": 1, "owner": 2}
    info = (await client.get_group_info([group_id]))[0]
    assert set(info.members) == {"owner", "bob"} and info.member_num == 2
    await client.delete_group_member(group_id, ["bob", "carol"])  # carol was never in: fine
    info = (await client.get_group_info([group_id]))[0]
    assert info.members == ("owner",)
    with pytest.raises(ImPermanentError) as err:
        await client.add_group_member(group_id, ["ghost"])
    assert err.value.code == 10019


async def test_avchatroom_membership_control(client: TencentImClient, sandbox: RunningSandbox) -> None:
    group_id = await room_group(client)
    await client.account_import("bob")
    with pytest.raises(ImPermanentError) as err:
        await client.add_group_member(group_id, ["bob"])
    assert err.value.code == 10007
    with pytest.raises(ImPermanentError) as err:
        await client.delete_group_member(group_id, ["bob"])
    assert err.value.code == 10004  # AVChatRoom: ban or mute instead
    await client.ban_group_member(group_id, ["bob"], 600, description="kicked")
    await client.forbid_send_msg(group_id, ["bob"], 600)
    group = sandbox.state.group(group_id)
    assert group is not None
    now = sandbox.state.now()
    assert 590 < group.banned["bob"] - now <= 600
    assert 590 < group.muted["bob"] - now <= 600
    with pytest.raises(ImPermanentError) as err:
        await client.send_group_msg(group_id, "{}", random=7, from_account="bob")
    assert err.value.code == 10017  # muted
    await client.forbid_send_msg(group_id, ["bob"], 0)  # unmute
    await client.send_group_msg(group_id, "{}", random=7, from_account="bob")


async def test_ban_without_the_feature_answers_10059(client: TencentImClient, sandbox: RunningSandbox) -> None:
    group_id = await room_group(client)
    sandbox.state.ban_enabled = False
    with pytest.raises(ImPermanentError) as err:
        await client.ban_group_member(group_id, ["bob"], 60)
    assert err.value.code == 10059


async def test_group_system_notification(client: TencentImClient, sandbox: RunningSandbox) -> None:
    av = await room_group(client)
    public = await room_group(client, "r2", group_type="Public")
    await client.send_group_system_notification(av, "hello all")
    await client.send_group_system_notification(public, "hello owner", to_members=["owner"])
    with pytest.raises(ImPermanentError) as err:
        await client.send_group_system_notification(av, "only some", to_members=["owner"])
    assert err.value.code == 10004
    assert [n["content"] for n in sandbox.state.group(av).notifications] == ["hello all"]  # type: ignore[union-attr]


async def test_destroy_group_and_group_not_found(client: TencentImClient, sandbox: RunningSandbox) -> None:
    group_id = await room_group(client)
    await client.send_group_msg(group_id, "last words", random=1)
    await client.destroy_group(group_id)
    with pytest.raises(ImPermanentError) as err:
        await client.destroy_group(group_id)
    assert err.value.code in GROUP_NOT_FOUND_CODES
    with pytest.raises(ImPermanentError) as err:
        await client.send_group_msg(group_id, "too late", random=2)
    assert err.value.code in GROUP_NOT_FOUND_CODES
    assert [m.data for m in sandbox.state.messages(group_id)] == ["last words"]  # still readable


async def test_create_group_existing_id(client: TencentImClient) -> None:
    group_id = await room_group(client)
    with pytest.raises(ImPermanentError) as err:
        await client.create_group(group_id, "owner", "Room", "AVChatRoom")
    assert err.value.code == 10025  # exists and you own it: the publisher treats it as success
    await client.account_import("mallory")
    with pytest.raises(ImPermanentError) as err:
        await client.create_group(group_id, "mallory", "Room", "AVChatRoom")
    assert err.value.code == 10021  # taken by someone else


async def test_an_existing_id_can_answer_10021_to_its_owner(client: TencentImClient, sandbox: RunningSandbox) -> None:
    group_id = await room_group(client)
    async with httpx.AsyncClient(transport=sandbox.transport(), base_url=sandbox.base_url) as http:
        answer = await http.post("/_sandbox/features", json={"owned_group_answers_10021": True})
    assert answer.json()["owned_group_answers_10021"] is True and sandbox.state.owned_group_answers_10021
    with pytest.raises(ImPermanentError) as err:
        await client.create_group(group_id, "owner", "Room", "AVChatRoom")
    assert err.value.code == 10021  # as Tencent may answer: 10025 is worded for the operator (our admin)
    [info] = await client.get_group_info([group_id], base_fields=("Type", "Owner_Account"))
    assert (info.type, info.owner_account) == ("AVChatRoom", "owner")  # what tells it is ours
    sandbox.state.reset()
    assert not sandbox.state.owned_group_answers_10021


async def test_create_group_owner_must_be_imported(client: TencentImClient) -> None:
    with pytest.raises(ImPermanentError) as err:
        await client.create_group("room_app-x", "never-imported", "Room", "AVChatRoom")
    assert err.value.code == 10019


async def test_c2c_message(client: TencentImClient, sandbox: RunningSandbox) -> None:
    await client.multiaccount_import(["bob", "system"])
    data, random, seq = '{"notice":"kicked"}', random_for("k1"), random_for("seq:k1")
    result = await client.send_c2c_msg("bob", data, random=random, msg_seq=seq, from_account="system")
    assert result.msg_key and result.msg_time > 0
    again = await client.send_c2c_msg("bob", data, random=random, msg_seq=seq, from_account="system")
    assert again == result  # Tencent's one-to-one duplicate window (120 s)
    [message] = sandbox.state.c2c_messages("bob")
    assert message.from_account == "system" and message.data == data
    assert (message.msg_seq, message.msg_random) == (seq, random)
    with pytest.raises(ValueError, match="msg_seq"):
        await client.send_c2c_msg("bob", data, random=random, msg_seq=-1)
    with pytest.raises(ImPermanentError) as err:
        await client.send_c2c_msg("ghost", "{}", random=1)
    assert err.value.code == 20003


async def test_uds_sandbox(tmp_path: Path) -> None:
    async with (
        running_sandbox(APP, KEY, uds=str(tmp_path / "im.sock")) as sandbox,
        make_client(sandbox) as im,
    ):
        await im.account_import("alice")
        assert "alice" in sandbox.state.accounts


async def test_from_config(sandbox: RunningSandbox) -> None:
    config = TencentIMConfig(admin_identifier=ADMIN, secret_key=SecretStr(""), rate_limit_per_second=50)
    async with TencentImClient.from_config(config, base_url=sandbox.base_url, sdk_app_id=APP, secret_key=KEY) as im:
        assert im.request_timeout == 3.0 and im.usersig_ttl == 86_400
        await im.account_import("alice")


# --------------------------------------------------------------------------- error families


@pytest.mark.parametrize("code", sorted(RETRYABLE_CODES))
async def test_retryable_codes(client: TencentImClient, sandbox: RunningSandbox, code: int) -> None:
    sandbox.state.inject_error("account_import", code, count=1)
    with pytest.raises(ImRetryableError) as err:
        await client.account_import("alice")
    assert err.value.code == code and err.value.command == "account_import"
    await client.account_import("alice")  # the injection was for one call


@pytest.mark.parametrize("code", [10004, 10007, 10010, 10021, 10025, 80001, 90001])
async def test_permanent_codes(client: TencentImClient, sandbox: RunningSandbox, code: int) -> None:
    sandbox.state.inject_error("destroy_group", code, "nope", count=1)
    with pytest.raises(ImPermanentError) as err:
        await client.destroy_group("g")
    assert (err.value.code, err.value.info) == (code, "nope")
    assert not err.value.retryable


async def test_usersig_expiry_answer_refreshes_and_retries_once(
    client: TencentImClient, sandbox: RunningSandbox
) -> None:
    await client.account_import("alice")
    assert client.usersig_generations == 1
    sandbox.state.force_usersig_expiry(1)
    await client.account_import("bob")  # 70001, new UserSig, retried: success
    assert client.usersig_generations == 2
    assert "bob" in sandbox.state.accounts
    assert sandbox.state.request_counts() == {"account_import": 3}


async def test_persistent_usersig_expiry_is_a_signature_error(client: TencentImClient, sandbox: RunningSandbox) -> None:
    sandbox.state.force_usersig_expiry(2)
    with pytest.raises(ImSignatureError) as err:
        await client.account_import("alice")
    assert err.value.code == 70001 and err.value.retryable
    assert client.usersig_generations == 2
    assert sandbox.state.request_counts() == {"account_import": 2}  # one retry, not more


async def test_clock_far_behind_gives_signature_error(sandbox: RunningSandbox) -> None:
    async with make_client(sandbox, usersig_ttl=3600, wall_clock=lambda: time.time() - 7200) as im:
        with pytest.raises(ImSignatureError) as err:
            await im.account_import("alice")
    assert err.value.code == 70001


async def test_wrong_key_is_a_signature_error_without_retry(sandbox: RunningSandbox) -> None:
    async with make_client(sandbox, secret_key="wrong") as im:
        with pytest.raises(ImSignatureError) as err:
            await im.account_import("alice")
    assert err.value.code == 70009
    assert sandbox.state.request_counts() == {"account_import": 1}


async def test_http_503_outage_is_retryable(client: TencentImClient, sandbox: RunningSandbox) -> None:
    sandbox.state.set_outage("http_503")
    with pytest.raises(ImRetryableError) as err:
        await client.account_import("alice")
    assert err.value.http_status == 503
    sandbox.state.set_outage(None)
    await client.account_import("alice")


async def test_connection_reset_outage_is_retryable(client: TencentImClient, sandbox: RunningSandbox) -> None:
    sandbox.state.set_outage("reset")
    for _ in range(3):
        with pytest.raises(ImRetryableError):
            await client.account_import("alice")
    sandbox.state.set_outage(None)
    await client.account_import("alice")
    assert "alice" in sandbox.state.accounts


async def test_connection_refused_is_retryable() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    im = TencentImClient(base_url=f"http://127.0.0.1:{port}", sdk_app_id=APP, admin_identifier=ADMIN, secret_key=KEY)
    async with im:
        with pytest.raises(ImRetryableError):
            await im.account_import("alice")


async def test_latency_beyond_the_timeout_is_retryable(sandbox: RunningSandbox) -> None:
    sandbox.state.set_latency(2.0, "account_import")
    async with make_client(sandbox, request_timeout=0.2) as im:
        started = time.monotonic()
        with pytest.raises(ImRetryableError, match="timed out"):
            await im.account_import("alice")
        assert time.monotonic() - started < 1.5


async def test_deadline_bounds_the_request(sandbox: RunningSandbox, client: TencentImClient) -> None:
    sandbox.state.set_latency(2.0, "account_import")
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    with pytest.raises(ImRetryableError, match="timed out"):
        await client.account_import("alice", deadline=loop.time() + 0.2)  # request_timeout is 5 s
    assert time.monotonic() - started < 1.5


async def test_request_timeout_bounds_the_whole_call_its_70001_retry_included(sandbox: RunningSandbox) -> None:
    """Without a deadline (the notice group passes none) a call took a request_timeout for each attempt."""
    sandbox.state.set_latency(0.4, "account_import")
    sandbox.state.force_usersig_expiry(1)  # the first attempt: 70001 after 0.4 s, then one retry
    async with make_client(sandbox, request_timeout=0.6) as im:
        with pytest.raises(ImRetryableError):  # the retry had 0.2 s of the call's 0.6 s left
            await im.account_import("alice")
        assert im.usersig_generations == 2
        await im.account_import("bob")  # 0.4 s: within a call's bound


async def test_passed_deadline_sends_nothing(client: TencentImClient, sandbox: RunningSandbox) -> None:
    loop = asyncio.get_running_loop()
    with pytest.raises(ImRetryableError, match="deadline"):
        await client.account_import("alice", deadline=loop.time() - 1)
    assert sandbox.state.request_counts() == {}


async def test_http_error_statuses() -> None:
    import httpx

    def answer(status: int, body: bytes = b"") -> Callable[[httpx.Request], httpx.Response]:
        return lambda request: httpx.Response(status, content=body)

    async def call(handler: Callable[[httpx.Request], httpx.Response]) -> None:
        transport = httpx.MockTransport(handler)
        im = TencentImClient(
            base_url="http://im.test", sdk_app_id=APP, admin_identifier=ADMIN, secret_key=KEY, transport=transport
        )
        async with im:
            await im.destroy_group("g")

    for status in (500, 502, 429, 408, 425):
        with pytest.raises(ImRetryableError) as err:
            await call(answer(status))
        assert err.value.http_status == status
    with pytest.raises(ImPermanentError) as perm:
        await call(answer(404))
    assert perm.value.http_status == 404
    with pytest.raises(ImRetryableError, match="not JSON"):
        await call(answer(200, b"<html>gateway</html>"))
    with pytest.raises(ImRetryableError, match="ActionStatus"):
        await call(answer(200, b'{"ActionStatus": "FAIL"}'))

    seen: list[httpx.Request] = []

    def ok(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ActionStatus": "OK", "ErrorCode": 0, "ErrorInfo": ""})

    await call(ok)
    [request] = seen
    assert request.method == "POST" and request.url.path == "/v4/group_open_http_svc/destroy_group"
    params = request.url.params
    assert params["sdkappid"] == str(APP) and params["identifier"] == ADMIN and params["contenttype"] == "json"
    assert 0 <= int(params["random"]) <= 0xFFFFFFFF and params["usersig"]
    assert json.loads(request.content) == {"GroupId": "g"}


# --------------------------------------------------------------------------- UserSig cache


async def test_usersig_cached_and_refreshed_at_90_percent(sandbox: RunningSandbox) -> None:
    wall = [time.time()]
    async with make_client(sandbox, usersig_ttl=1000, wall_clock=lambda: wall[0]) as im:
        for _ in range(3):
            await im.account_import("alice")
        assert im.usersig_generations == 1
        first = im.usersig()
        wall[0] += 899
        await im.account_import("alice")
        assert im.usersig_generations == 1 and im.usersig() == first
        wall[0] += 2  # 901 s: past 90% of the lifetime
        await im.account_import("alice")
        assert im.usersig_generations == 2 and im.usersig() != first
        await asyncio.gather(*(im.account_import(f"u{i}") for i in range(10)))
        assert im.usersig_generations == 2


# --------------------------------------------------------------------------- rate limit


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


def test_token_bucket_refills_at_the_rate() -> None:
    bucket = TokenBucket(10, 2, now=0.0)
    assert bucket.reserve(0.0) == 0.0
    assert bucket.reserve(0.0) == 0.0
    assert bucket.reserve(0.0) == pytest.approx(0.1)  # reserved: the balance goes below zero
    assert bucket.reserve(0.0) == pytest.approx(0.2)
    assert bucket.reserve(0.0, latest=0.25) is None  # would wait 0.3 s: nothing taken
    assert bucket.reserve(0.0, latest=0.3) == pytest.approx(0.3)
    assert bucket.tokens(10.0) == 2  # capped at the burst


async def test_rate_limiter_spaces_requests_per_api() -> None:
    fake = FakeTime()
    limiter = RateLimiter(20, burst=1, clock=fake.clock, sleep=fake.sleep)
    waits = [await limiter.acquire("group_open_http_svc/send_group_msg") for _ in range(5)]
    assert waits == pytest.approx([0.0, 0.05, 0.10, 0.15, 0.20])
    assert await limiter.acquire("openim/sendmsg") == 0.0  # another API has its own bucket
    fake.now += 1.0
    assert await limiter.acquire("group_open_http_svc/send_group_msg") == 0.0


async def test_rate_limiter_never_waits_past_the_deadline() -> None:
    fake = FakeTime()
    limiter = RateLimiter(2, burst=1, clock=fake.clock, sleep=fake.sleep)
    await limiter.acquire("a")
    with pytest.raises(RateLimitExceeded):
        await limiter.acquire("a", deadline=fake.now + 0.1)  # next slot in 0.5 s
    assert fake.sleeps == []
    assert await limiter.acquire("a", deadline=fake.now + 0.5) == pytest.approx(0.5)


async def test_rate_limiter_refunds_a_cancelled_wait() -> None:
    limiter = RateLimiter(1, burst=1)
    await limiter.acquire("a")
    waiter = asyncio.create_task(limiter.acquire("a"))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    loop = asyncio.get_running_loop()
    assert limiter.bucket("a").tokens(loop.time()) > -0.5  # the reservation was given back


def test_default_burst_is_a_tenth_of_the_rate() -> None:
    assert RateLimiter(200).burst == 20
    assert RateLimiter(5).burst == 1


async def test_client_rate_limit_spaces_requests_seen_by_the_sandbox(sandbox: RunningSandbox) -> None:
    rate, n = 20.0, 10
    async with make_client(sandbox, rate_limit_per_second=rate, rate_limit_burst=1) as im:
        await asyncio.gather(*(im.get_group_info(["g"]) for _ in range(n)))
    stamps = sorted(r.monotonic for r in sandbox.state.requests if r.command == "get_group_info")
    assert len(stamps) == n
    # a lower bound only (sleeping longer never breaks it): n requests, 1 free, the rest 1/rate apart
    assert stamps[-1] - stamps[0] >= (n - 1) / rate * 0.9


async def test_client_rate_limit_bounded_by_the_deadline(sandbox: RunningSandbox) -> None:
    async with make_client(sandbox, rate_limit_per_second=1, rate_limit_burst=1) as im:
        await im.account_import("alice")
        loop = asyncio.get_running_loop()
        with pytest.raises(ImRetryableError, match="rate limit"):
            await im.account_import("bob", deadline=loop.time() + 0.2)
    assert sandbox.state.request_counts() == {"account_import": 1}


async def test_sandbox_throttling_is_retryable(client: TencentImClient, sandbox: RunningSandbox) -> None:
    sandbox.state.set_rate_limit(3)
    codes = []
    for _ in range(8):
        try:
            await client.get_group_info(["g"])
            codes.append(0)
        except ImRetryableError as exc:
            codes.append(exc.code)
    assert 60007 in codes and codes[0] == 0


# --------------------------------------------------------------------------- ids


def test_group_id_for_is_deterministic_short_and_unambiguous() -> None:
    assert group_id_for("app", "room-1") == "room_app-room-1"
    assert group_id_for("a_b", "c") != group_id_for("a", "b_c")
    long_a = group_id_for("a" * 32, "r" * 48)
    long_b = group_id_for("a" * 32, "r" * 47 + "s")
    assert long_a.startswith("roomh_") and len(long_a) <= 48 and long_a != long_b
    assert group_id_for("a" * 32, "r" * 48) == long_a
    for app, room in [("x", "y"), ("a" * 32, "r" * 48), ("abc", "R" * 40)]:
        gid = group_id_for(app, room)
        assert len(gid.encode()) <= 48 and not gid.startswith("@TGS#")
        community = group_id_for(app, room, group_type="Community")
        assert community.startswith("@TGS#_") and len(community.encode()) <= 48


def test_account_id_for_fits_32_bytes() -> None:
    assert account_id_for("alice") == "alice"
    long_id = "u" * 64
    assert account_id_for(long_id) == account_id_for(long_id)
    assert len(account_id_for(long_id)) == 32 and account_id_for(long_id) != account_id_for("u" * 63 + "v")


def test_no_user_id_gets_the_account_of_a_hashed_one() -> None:
    victim = "v" * 64  # a long id: its account is hashed
    hashed = account_id_for(victim)
    assert hashed.startswith("u_") and len(hashed) == 32
    squatter = account_id_for(hashed)  # a user who chose the victim's account as their own id
    assert squatter != hashed and squatter.startswith("u_") and len(squatter) == 32
    assert account_id_for(hashed) == squatter  # still deterministic
    for id_of_hashed_form in ("u_" + "0" * 30, "u_" + "abcdef0123" * 3):
        assert account_id_for(id_of_hashed_form) != id_of_hashed_form
    # every other id of at most 32 bytes keeps its account (existing accounts do not move)
    for kept in ("alice", "u_" + "A" * 30, "u_" + "0" * 29, "u-" + "0" * 30, "x" * 32, "u_abc"):
        assert account_id_for(kept) == kept


def test_random_for_is_a_stable_uint32() -> None:
    assert random_for("event") == random_for("event")
    assert random_for("event") != random_for("event2")
    assert 0 <= random_for("x") <= 0xFFFFFFFF


async def test_hashed_and_community_ids_are_accepted(client: TencentImClient, sandbox: RunningSandbox) -> None:
    await client.account_import("owner")
    for group_type in ("AVChatRoom", "Community"):
        group_id = group_id_for("a" * 32, "r" * 48, group_type=group_type)
        assert await client.create_group(group_id, "owner", "Room", group_type) == group_id
    assert len(sandbox.state.groups) == 2
