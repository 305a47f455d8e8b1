"""The IM sandbox directly over HTTP (httpx, no client): signature checks, Tencent's
group semantics (10025/10021, AVChatRoom limits) and the control API."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import pytest_asyncio

from roomservice.integrations.im_sandbox import RunningSandbox, running_sandbox
from roomservice.integrations.tencent_im.usersig import gen_usersig

APP = 1_400_000_002
KEY = "sandbox-http-key"
ADMIN = "administrator"


@pytest_asyncio.fixture
async def sandbox() -> AsyncIterator[RunningSandbox]:
    async with running_sandbox(APP, KEY, admin_identifiers=[ADMIN, "ops"]) as running:
        yield running


@pytest_asyncio.fixture
async def http(sandbox: RunningSandbox) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sandbox.base_url) as client:
        yield client


def sig_for(
    identifier: str = ADMIN, *, app: int = APP, key: str = KEY, ttl: int = 3600, at: float | None = None
) -> str:
    return gen_usersig(app, key, identifier, ttl, int(time.time() if at is None else at))


async def rest(
    http: httpx.AsyncClient,
    service: str,
    command: str,
    body: Any,
    *,
    identifier: str = ADMIN,
    usersig: str | None = None,
    sdkappid: str | None = str(APP),
) -> dict[str, Any]:
    params = {"identifier": identifier, "usersig": usersig or sig_for(identifier), "random": "42"}
    params["contenttype"] = "json"
    if sdkappid is not None:
        params["sdkappid"] = sdkappid
    content = body if isinstance(body, bytes) else httpx.Request("POST", "/", json=body).content
    response = await http.post(f"/v4/{service}/{command}", params=params, content=content)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    assert set(data) >= {"ActionStatus", "ErrorCode", "ErrorInfo"}
    assert (data["ActionStatus"] == "OK") == (data["ErrorCode"] == 0)
    return data


async def group_call(http: httpx.AsyncClient, command: str, body: Any, **kw: Any) -> dict[str, Any]:
    return await rest(http, "group_open_http_svc", command, body, **kw)


async def imports(http: httpx.AsyncClient, *accounts: str) -> None:
    data = await rest(http, "im_open_login_svc", "multiaccount_import", {"Accounts": list(accounts)})
    assert data["ErrorCode"] == 0 and data["FailAccounts"] == []


# --------------------------------------------------------------------------- signature checks


async def test_a_valid_admin_call_succeeds(http: httpx.AsyncClient) -> None:
    data = await rest(http, "im_open_login_svc", "account_import", {"UserID": "alice", "Nick": "A"})
    assert data == {"ActionStatus": "OK", "ErrorCode": 0, "ErrorInfo": ""}
    data = await rest(http, "im_open_login_svc", "account_import", {"UserID": "bob"}, identifier="ops")
    assert data["ErrorCode"] == 0  # any configured admin


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"sdkappid": None}, 60012),
        ({"sdkappid": "1400000999"}, 60006),
        ({"sdkappid": "abc"}, 60006),
        ({"usersig": "x"}, 70003),  # not decodable
        ({"usersig": sig_for(key="another-key")}, 70009),
        ({"usersig": sig_for(ttl=60, at=time.time() - 120)}, 70001),
        ({"usersig": sig_for(app=APP + 1)}, 70014),
        ({"usersig": sig_for("ops")}, 70013),  # a valid sig for another identifier
        ({"identifier": "alice", "usersig": sig_for("alice")}, 60010),  # valid, but not an admin
    ],
)
async def test_signature_and_identity_checks(http: httpx.AsyncClient, kwargs: dict[str, Any], code: int) -> None:
    data = await rest(http, "im_open_login_svc", "account_import", {"UserID": "alice"}, **kwargs)
    assert data["ErrorCode"] == code and data["ActionStatus"] == "FAIL" and data["ErrorInfo"]


async def test_a_usersig_accepted_before_is_still_checked_for_expiry_and_key(
    http: httpx.AsyncClient, sandbox: RunningSandbox
) -> None:
    sig = sig_for(ttl=60)
    for _ in range(2):  # the second call meets the check the first one kept
        assert (await rest(http, "im_open_login_svc", "account_import", {"UserID": "a"}, usersig=sig))["ErrorCode"] == 0
    sandbox.state.clock_offset = 120  # the sandbox's clock is past the sig's expiry now
    assert (await rest(http, "im_open_login_svc", "account_import", {"UserID": "a"}, usersig=sig))["ErrorCode"] == 70001
    sandbox.state.clock_offset = 0
    sandbox.state.secret_key = "rotated"  # the kept check was for the old key
    assert (await rest(http, "im_open_login_svc", "account_import", {"UserID": "a"}, usersig=sig))["ErrorCode"] == 70009


async def test_missing_identifier_or_usersig(http: httpx.AsyncClient) -> None:
    response = await http.post("/v4/im_open_login_svc/account_import", params={"sdkappid": str(APP)}, json={})
    assert response.json()["ErrorCode"] == 60004


async def test_bad_body_and_unknown_api(http: httpx.AsyncClient) -> None:
    assert (await rest(http, "im_open_login_svc", "account_import", b"{nope"))["ErrorCode"] == 60003
    assert (await rest(http, "im_open_login_svc", "account_import", [1, 2]))["ErrorCode"] == 60003
    deep = b"[" * 30_000 + b"]" * 30_000  # deeper than the JSON parser's stack: not JSON, not a 500
    assert (await rest(http, "im_open_login_svc", "account_import", deep))["ErrorCode"] == 60003
    control = await http.post("/_sandbox/clock", content=deep, headers={"content-type": "application/json"})
    assert control.status_code == 400 and "too deeply" in control.json()["error"]
    assert (await rest(http, "group_open_http_svc", "no_such_command", {}))["ErrorCode"] == 60009


async def test_user_ids_are_at_most_32_bytes(http: httpx.AsyncClient) -> None:
    assert (await rest(http, "im_open_login_svc", "account_import", {"UserID": "x" * 33}))["ErrorCode"] == 70402
    data = await rest(http, "im_open_login_svc", "multiaccount_import", {"Accounts": ["ok", "x" * 33]})
    assert data["FailAccounts"] == ["x" * 33]


# --------------------------------------------------------------------------- group semantics


async def test_create_group_existing_id_10025_vs_10021(http: httpx.AsyncClient) -> None:
    await imports(http, "owner", "other")
    body = {"Owner_Account": "owner", "Type": "AVChatRoom", "GroupId": "room_app-1", "Name": "Room"}
    assert (await group_call(http, "create_group", body))["GroupId"] == "room_app-1"
    assert (await group_call(http, "create_group", body))["ErrorCode"] == 10025
    assert (await group_call(http, "create_group", {**body, "Owner_Account": "other"}))["ErrorCode"] == 10021
    assert (await group_call(http, "create_group", {**body, "Owner_Account": None}))["ErrorCode"] == 10021


async def test_create_group_validation(http: httpx.AsyncClient) -> None:
    await imports(http, "owner")
    base = {"Owner_Account": "owner", "Type": "Public", "Name": "Room"}
    cases = [
        ({"GroupId": "@TGS#mine"}, 10004),
        ({"GroupId": "g" * 49}, 10004),
        ({"GroupId": "tab\there"}, 10004),
        ({"GroupId": "plain", "Type": "Community"}, 10004),
        ({"GroupId": "x", "Name": "名" * 11}, 10004),  # 33 bytes
        ({"GroupId": "x", "Type": "Nope"}, 10004),
        ({"GroupId": "x", "Owner_Account": "ghost"}, 10019),
        ({"GroupId": "x", "Type": "AVChatRoom", "MemberList": [{"Member_Account": "owner"}]}, 10007),
    ]
    for change, code in cases:
        assert (await group_call(http, "create_group", {**base, **change}))["ErrorCode"] == code, change
    assert (await group_call(http, "create_group", {**base, "GroupId": "g" * 48}))["ErrorCode"] == 0
    generated = await group_call(http, "create_group", {"Type": "AVChatRoom", "Name": "no id"})
    assert generated["GroupId"].startswith("@TGS#a")


async def test_avchatroom_member_restrictions(http: httpx.AsyncClient, sandbox: RunningSandbox) -> None:
    await imports(http, "owner", "bob")
    await group_call(
        http, "create_group", {"Owner_Account": "owner", "Type": "AVChatRoom", "GroupId": "av", "Name": "R"}
    )
    add = {"GroupId": "av", "MemberList": [{"Member_Account": "bob"}]}
    assert (await group_call(http, "add_group_member", add))["ErrorCode"] == 10007
    delete = {"GroupId": "av", "MemberToDel_Account": ["bob"]}
    assert (await group_call(http, "delete_group_member", delete))["ErrorCode"] == 10004
    ban = {"GroupId": "av", "Members_Account": ["bob"], "Duration": 60}
    assert (await group_call(http, "ban_group_member", ban))["ErrorCode"] == 0
    assert (await group_call(http, "ban_group_member", {**ban, "Duration": 0}))["ErrorCode"] == 10004
    mute = {"GroupId": "av", "Members_Account": ["bob"], "ShutUpTime": 60}
    assert (await group_call(http, "forbid_send_msg", mute))["ErrorCode"] == 0
    info = (await group_call(http, "get_group_info", {"GroupIdList": ["av"]}))["GroupInfo"][0]
    assert info["Type"] == "AVChatRoom" and "MemberList" not in info  # no member list for AVChatRoom
    detail = (await http.get("/_sandbox/groups/av")).json()
    assert set(detail["banned"]) == {"bob"} and set(detail["muted"]) == {"bob"}


async def test_public_group_members_and_bans(http: httpx.AsyncClient) -> None:
    await imports(http, "owner", "bob")
    await group_call(http, "create_group", {"Owner_Account": "owner", "Type": "Public", "GroupId": "pub", "Name": "R"})
    add = {"GroupId": "pub", "MemberList": [{"Member_Account": "bob"}]}
    assert (await group_call(http, "add_group_member", add))["MemberList"] == [{"Member_Account": "bob", "Result": 1}]
    ban = {"GroupId": "pub", "Members_Account": ["bob"], "Duration": 60}
    assert (await group_call(http, "ban_group_member", ban))["ErrorCode"] == 0
    assert (await group_call(http, "add_group_member", add))["MemberList"] == [{"Member_Account": "bob", "Result": 0}]
    delete_owner = {"GroupId": "pub", "MemberToDel_Account": ["owner"]}
    assert (await group_call(http, "delete_group_member", delete_owner))["ErrorCode"] == 10004


async def test_messages_sequence_and_duplicates(http: httpx.AsyncClient, sandbox: RunningSandbox) -> None:
    await imports(http, "owner")
    await group_call(
        http, "create_group", {"Owner_Account": "owner", "Type": "AVChatRoom", "GroupId": "g", "Name": "R"}
    )

    def msg(random: int, data: str) -> dict[str, Any]:
        return {
            "GroupId": "g",
            "Random": random,
            "MsgBody": [{"MsgType": "TIMCustomElem", "MsgContent": {"Data": data}}],
        }

    first = await group_call(http, "send_group_msg", msg(1, "a"))
    assert first["MsgSeq"] == 1 and isinstance(first["MsgTime"], int)
    duplicate = await group_call(http, "send_group_msg", msg(1, "a"))
    assert (duplicate["MsgSeq"], duplicate["MsgTime"]) == (1, first["MsgTime"])
    assert (await group_call(http, "send_group_msg", msg(2, "b")))["MsgSeq"] == 2
    assert (await group_call(http, "send_group_msg", {**msg(3, "c"), "Random": -1}))["ErrorCode"] == 10004
    assert (await group_call(http, "send_group_msg", {**msg(3, "c"), "MsgBody": []}))["ErrorCode"] == 10004
    assert (await group_call(http, "send_group_msg", {**msg(3, "c"), "GroupId": "nope"}))["ErrorCode"] == 10010
    await http.post("/_sandbox/clock", json={"advance_s": 301})
    assert (await group_call(http, "send_group_msg", msg(1, "a")))["MsgSeq"] == 3
    listed = (await http.get("/_sandbox/groups/g/messages")).json()["messages"]
    assert [(m["msg_seq"], m["random"], m["from_account"], m["data"]) for m in listed] == [
        (1, 1, ADMIN, "a"),
        (2, 2, ADMIN, "b"),
        (3, 1, ADMIN, "a"),
    ]
    assert (await http.get("/_sandbox/groups/g")).json()["duplicates_absorbed"] == 1


async def test_destroy_group(http: httpx.AsyncClient) -> None:
    await imports(http, "owner")
    await group_call(http, "create_group", {"Owner_Account": "owner", "Type": "Public", "GroupId": "g", "Name": "R"})
    assert (await group_call(http, "destroy_group", {"GroupId": "g"}))["ErrorCode"] == 0
    assert (await group_call(http, "destroy_group", {"GroupId": "g"}))["ErrorCode"] == 10010
    info = (await group_call(http, "get_group_info", {"GroupIdList": ["g"]}))["GroupInfo"]
    assert info == [{"GroupId": "g", "ErrorCode": 10010, "ErrorInfo": "group does not exist"}]
    groups = (await http.get("/_sandbox/groups")).json()
    assert groups["groups"] == [] and [g["group_id"] for g in groups["destroyed"]] == ["g"]
    assert (await http.get("/_sandbox/groups/g")).json()["destroyed"] is True
    # the id can be used again after the group was dismissed
    again = {"Owner_Account": "owner", "Type": "Public", "GroupId": "g", "Name": "R"}
    assert (await group_call(http, "create_group", again))["ErrorCode"] == 0


C2C_BODY: dict[str, Any] = {
    "SyncOtherMachine": 2,
    "From_Account": "system",
    "To_Account": "bob",
    "MsgSeq": 77,
    "MsgRandom": 9,
    "MsgBody": [{"MsgType": "TIMCustomElem", "MsgContent": {"Data": "kicked", "Desc": "", "Ext": ""}}],
}


async def c2c_to(http: httpx.AsyncClient, to: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = (await http.get("/_sandbox/c2c", params={"to": to})).json()["messages"]
    return messages


async def test_c2c_messages(http: httpx.AsyncClient) -> None:
    await imports(http, "bob", "system")
    first = await rest(http, "openim", "sendmsg", C2C_BODY)
    assert first["ErrorCode"] == 0 and first["MsgKey"] and first["MsgTime"] > 0
    again = await rest(http, "openim", "sendmsg", C2C_BODY)
    assert (again["MsgKey"], again["MsgTime"]) == (first["MsgKey"], first["MsgTime"])  # duplicate absorbed
    listed = await c2c_to(http, "bob")
    assert [(m["from_account"], m["to_account"], m["msg_seq"], m["msg_random"], m["data"]) for m in listed] == [
        ("system", "bob", 77, 9, "kicked")
    ]
    assert await c2c_to(http, "nobody") == []
    assert (await http.get("/_sandbox/state")).json()["c2c_duplicates_absorbed"] == 1


async def test_c2c_accounts_must_be_imported(http: httpx.AsyncClient) -> None:
    await imports(http, "bob")
    assert (await rest(http, "openim", "sendmsg", {**C2C_BODY, "To_Account": "ghost"}))["ErrorCode"] == 20003
    assert (await rest(http, "openim", "sendmsg", C2C_BODY))["ErrorCode"] == 20003  # the sender "system" is unknown
    without_sender = {k: v for k, v in C2C_BODY.items() if k != "From_Account"}
    assert (await rest(http, "openim", "sendmsg", without_sender))["ErrorCode"] == 0  # the admin sends
    assert [m["from_account"] for m in await c2c_to(http, "bob")] == [ADMIN]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"MsgSeq": 78}, id="msg-seq"),
        pytest.param({"MsgRandom": 10}, id="msg-random"),
        pytest.param({"MsgBody": [{"MsgType": "TIMTextElem", "MsgContent": {"Text": "kicked"}}]}, id="body"),
        pytest.param({"From_Account": "other"}, id="sender"),
    ],
)
async def test_a_c2c_message_differing_in_any_part_of_the_key_is_a_new_message(
    http: httpx.AsyncClient, change: dict[str, Any]
) -> None:
    await imports(http, "bob", "system", "other")
    first = await rest(http, "openim", "sendmsg", C2C_BODY)
    second = await rest(http, "openim", "sendmsg", {**C2C_BODY, **change})
    assert second["ErrorCode"] == 0 and second["MsgKey"] != first["MsgKey"]
    assert len(await c2c_to(http, "bob")) == 2


async def test_a_c2c_message_without_msg_seq_is_never_a_duplicate(http: httpx.AsyncClient) -> None:
    await imports(http, "bob", "system")
    body = {k: v for k, v in C2C_BODY.items() if k != "MsgSeq"}
    first = await rest(http, "openim", "sendmsg", body)
    second = await rest(http, "openim", "sendmsg", body)
    assert first["MsgKey"] != second["MsgKey"]
    listed = await c2c_to(http, "bob")
    assert len(listed) == 2 and listed[0]["msg_seq"] != listed[1]["msg_seq"]


async def test_the_c2c_duplicate_window_is_120_seconds(http: httpx.AsyncClient) -> None:
    await imports(http, "bob", "system")
    first = await rest(http, "openim", "sendmsg", C2C_BODY)
    await http.post("/_sandbox/clock", json={"advance_s": 119})
    assert (await rest(http, "openim", "sendmsg", C2C_BODY))["MsgKey"] == first["MsgKey"]
    await http.post("/_sandbox/clock", json={"advance_s": 2})  # 121 s after the first send
    late = await rest(http, "openim", "sendmsg", C2C_BODY)
    assert late["ErrorCode"] == 0 and late["MsgKey"] != first["MsgKey"]
    assert len(await c2c_to(http, "bob")) == 2


async def test_c2c_under_an_outage_and_an_injected_error_stores_nothing(http: httpx.AsyncClient) -> None:
    await imports(http, "bob", "system")
    await http.post("/_sandbox/outage", json={"mode": "http_503"})
    response = await http.post(
        "/v4/openim/sendmsg",
        params={"sdkappid": str(APP), "identifier": ADMIN, "usersig": sig_for(), "contenttype": "json"},
        json=C2C_BODY,
    )
    assert response.status_code == 503
    await http.delete("/_sandbox/outage")
    await http.post("/_sandbox/errors", json={"command": "sendmsg", "service": "openim", "code": 90994, "count": 1})
    assert (await rest(http, "openim", "sendmsg", C2C_BODY))["ErrorCode"] == 90994
    assert await c2c_to(http, "bob") == []
    assert (await rest(http, "openim", "sendmsg", C2C_BODY))["ErrorCode"] == 0
    assert len(await c2c_to(http, "bob")) == 1
    entries = (await http.get("/_sandbox/requests", params={"command": "sendmsg"})).json()["entries"]
    assert [(r["http_status"], r["error_code"]) for r in entries] == [(503, 0), (200, 90994), (200, 0)]


# --------------------------------------------------------------------------- control API


async def test_outage_http_503_and_recovery(http: httpx.AsyncClient) -> None:
    assert (await http.post("/_sandbox/outage", json={"mode": "http_503"})).json()["outage"] == "http_503"
    response = await http.post(
        "/v4/im_open_login_svc/account_import",
        params={"sdkappid": str(APP), "identifier": ADMIN, "usersig": sig_for()},
        json={"UserID": "a"},
    )
    assert response.status_code == 503
    assert (await http.get("/_sandbox/healthz")).json() == {"ok": True}  # control API stays up
    await http.delete("/_sandbox/outage")
    assert (await rest(http, "im_open_login_svc", "account_import", {"UserID": "a"}))["ErrorCode"] == 0


async def test_outage_reset_breaks_the_connection(http: httpx.AsyncClient) -> None:
    await http.post("/_sandbox/outage", json={"mode": "reset"})
    with pytest.raises(httpx.TransportError):
        await http.post(
            "/v4/im_open_login_svc/account_import",
            params={"sdkappid": str(APP), "identifier": ADMIN, "usersig": sig_for()},
            json={"UserID": "a"},
        )
    await http.post("/_sandbox/outage", json={"mode": None})
    assert (await rest(http, "im_open_login_svc", "account_import", {"UserID": "a"}))["ErrorCode"] == 0


async def test_injected_errors(http: httpx.AsyncClient) -> None:
    await http.post("/_sandbox/errors", json={"command": "account_import", "code": 10002, "count": 2})
    await http.post("/_sandbox/errors", json={"command": "*", "code": 60018, "service": "openim"})
    codes = [(await rest(http, "im_open_login_svc", "account_import", {"UserID": "a"}))["ErrorCode"] for _ in range(3)]
    assert codes == [10002, 10002, 0]
    assert (await rest(http, "openim", "sendmsg", {}))["ErrorCode"] == 60018
    assert (await rest(http, "openim", "sendmsg", {}))["ErrorCode"] == 60018  # until cleared
    faults = (await http.delete("/_sandbox/errors")).json()
    assert faults["errors"] == []
    assert (await rest(http, "openim", "sendmsg", {}))["ErrorCode"] != 60018


async def test_injected_error_does_not_bypass_the_signature_check(http: httpx.AsyncClient) -> None:
    await http.post("/_sandbox/errors", json={"command": "account_import", "code": 10002})
    data = await rest(http, "im_open_login_svc", "account_import", {"UserID": "a"}, usersig=sig_for(key="bad"))
    assert data["ErrorCode"] == 70009


async def test_latency(http: httpx.AsyncClient) -> None:
    await http.post("/_sandbox/latency", json={"seconds": 0.3, "command": "account_import"})
    started = time.monotonic()
    await rest(http, "im_open_login_svc", "account_import", {"UserID": "a"})
    assert time.monotonic() - started >= 0.29  # a lower bound only
    assert (await http.delete("/_sandbox/latency")).json()["latency_s"] == {}


async def test_usersig_expiry_injection(http: httpx.AsyncClient) -> None:
    await http.post("/_sandbox/usersig_expiry", json={"count": 1})
    assert (await rest(http, "im_open_login_svc", "account_import", {"UserID": "a"}))["ErrorCode"] == 70001
    assert (await rest(http, "im_open_login_svc", "account_import", {"UserID": "a"}))["ErrorCode"] == 0


async def test_rate_limit(http: httpx.AsyncClient) -> None:
    await http.post("/_sandbox/rate_limit", json={"per_second": 2})
    codes = [(await rest(http, "im_open_login_svc", "account_import", {"UserID": "a"}))["ErrorCode"] for _ in range(4)]
    assert codes[:2] == [0, 0] and 60007 in codes[2:]
    assert (await rest(http, "openim", "sendmsg", {}))["ErrorCode"] != 60007  # per API
    await http.post("/_sandbox/rate_limit", json={"per_second": None})
    assert (await rest(http, "im_open_login_svc", "account_import", {"UserID": "a"}))["ErrorCode"] == 0


async def test_features_ban_switch(http: httpx.AsyncClient) -> None:
    await imports(http, "owner")
    await group_call(
        http, "create_group", {"Owner_Account": "owner", "Type": "AVChatRoom", "GroupId": "g", "Name": "R"}
    )
    await http.post("/_sandbox/features", json={"ban_group_member": False})
    ban = {"GroupId": "g", "Members_Account": ["bob"], "Duration": 60}
    assert (await group_call(http, "ban_group_member", ban))["ErrorCode"] == 10059


async def test_read_api_and_request_log(http: httpx.AsyncClient, sandbox: RunningSandbox) -> None:
    await imports(http, "owner", "bob")
    created = await group_call(http, "create_group", {"Owner_Account": "owner", "Type": "Public", "Name": "R"})
    group_id = created["GroupId"]
    assert group_id.startswith("@TGS#")
    notify = {"GroupId": group_id, "Content": "hi", "ToMembers_Account": ["owner"]}
    assert (await group_call(http, "send_group_system_notification", notify))["ErrorCode"] == 0
    detail = (await http.get(f"/_sandbox/groups/{quote(group_id, safe='')}")).json()
    assert detail["owner"] == "owner" and detail["members"] == ["owner"] and detail["type"] == "Public"
    notes = (await http.get(f"/_sandbox/groups/{quote(group_id, safe='')}/notifications")).json()
    assert [n["content"] for n in notes["notifications"]] == ["hi"]
    assert (await http.get("/_sandbox/groups/missing")).status_code == 404
    accounts = (await http.get("/_sandbox/accounts")).json()["accounts"]
    assert sorted(a["user_id"] for a in accounts) == ["bob", "owner"]
    await rest(http, "im_open_login_svc", "account_import", {"UserID": "x"}, usersig=sig_for(key="bad"))
    log = (await http.get("/_sandbox/requests")).json()
    assert log["counts"] == {
        "multiaccount_import": 1,
        "create_group": 1,
        "send_group_system_notification": 1,
        "account_import": 1,
    }
    assert log["entries"][-1]["error_code"] == 70009 and log["entries"][-1]["identifier"] == ADMIN
    filtered = (await http.get("/_sandbox/requests", params={"command": "create_group"})).json()["entries"]
    assert [e["command"] for e in filtered] == ["create_group"]
    assert len((await http.get("/_sandbox/requests", params={"limit": "2"})).json()["entries"]) == 2
    summary = (await http.get("/_sandbox/state")).json()
    assert summary["sdk_app_id"] == APP and summary["accounts"] == 2 and len(summary["groups"]) == 1
    assert sandbox.state.request_counts(errors_only=True) == {"account_import": 1}


async def test_reset(http: httpx.AsyncClient, sandbox: RunningSandbox) -> None:
    await imports(http, "owner")
    await http.post("/_sandbox/errors", json={"command": "create_group", "code": 10002})
    await http.post("/_sandbox/reset")
    assert sandbox.state.accounts == {} and sandbox.state.requests == [] and sandbox.state.errors == []
    assert (await rest(http, "im_open_login_svc", "account_import", {"UserID": "a"}))["ErrorCode"] == 0


async def test_bad_control_input_is_400(http: httpx.AsyncClient) -> None:
    assert (await http.post("/_sandbox/errors", json={"code": 1})).status_code == 400  # no command
    assert (await http.post("/_sandbox/outage", json={"mode": "sideways"})).status_code == 400
    assert (await http.post("/_sandbox/latency", content=b"[1]")).status_code == 400
    assert (await http.post("/_sandbox/errors", json={"command": "x", "code": 1, "count": 0})).status_code == 400


async def test_two_sandboxes_do_not_collide() -> None:
    async with running_sandbox(APP, KEY) as one, running_sandbox(APP, KEY) as two:
        assert one.port != two.port
        async with httpx.AsyncClient() as client:
            for running in (one, two):
                assert (await client.get(f"{running.base_url}/_sandbox/healthz")).json() == {"ok": True}


async def test_stop_closes_the_port() -> None:
    async with running_sandbox(APP, KEY) as running:
        url = running.base_url
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"{url}/_sandbox/healthz")


async def test_busy_port_is_an_error(sandbox: RunningSandbox) -> None:
    with pytest.raises(OSError, match="in use"):
        async with running_sandbox(APP, KEY, port=sandbox.port):
            pass  # pragma: no cover


async def test_run_sandbox_until_stopped() -> None:
    from roomservice.integrations.im_sandbox import run_sandbox

    stop = asyncio.Event()
    started: list[RunningSandbox] = []
    task = asyncio.create_task(
        run_sandbox("127.0.0.1", 0, sdk_app_id=APP, secret_key=KEY, stop=stop, on_started=started.append)
    )
    while not started and not task.done():
        await asyncio.sleep(0.01)
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{started[0].base_url}/_sandbox/healthz")).status_code == 200
    stop.set()
    await asyncio.wait_for(task, 5)
