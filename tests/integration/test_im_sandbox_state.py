"""The IM sandbox keeps its state under a directory: a stop and start on the same dir sees
the same accounts, groups, members, bans, messages and counters; a crash (``kill -9`` of
``room-service im-sandbox``) loses nothing it answered; one process at a time.

The sandbox runs as a real server (loopback HTTP) driven by the real client, and is read
back through its control API, so a restart is what ``room-service serve`` does with it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from roomservice.integrations.im_sandbox import (
    RunningSandbox,
    SandboxJournal,
    SandboxStateInUse,
    running_sandbox,
    state_file,
)
from roomservice.integrations.tencent_im.client import TencentImClient
from roomservice.integrations.tencent_im.errors import ImPermanentError, ImRetryableError

APP = 1_400_000_077
KEY = "sandbox-state-key"
ADMIN = "administrator"
AV, PUBLIC = "g-av", "g-public"


@asynccontextmanager
async def sandbox_on(
    state_dir: Path | None, *, key: str = KEY
) -> AsyncIterator[tuple[RunningSandbox, TencentImClient]]:
    async with (
        running_sandbox(APP, key, rate_limit_per_second=None, state_dir=state_dir) as sandbox,
        client_for(sandbox.base_url, key=key) as im,
    ):
        yield sandbox, im


def client_for(base_url: str, *, key: str = KEY) -> TencentImClient:
    return TencentImClient(
        base_url=base_url, sdk_app_id=APP, admin_identifier=ADMIN, secret_key=key, request_timeout=5.0
    )


async def control(base_url: str, path: str, *, method: str = "GET") -> Any:
    async with httpx.AsyncClient(base_url=base_url) as http:
        response = await http.request(method, f"/_sandbox/{path}")
        response.raise_for_status()
        return response.json()


async def everything(base_url: str) -> dict[str, Any]:
    """What the control API shows of the state (groups live and destroyed, their messages and
    notifications, accounts, one-to-one messages)."""
    groups = await control(base_url, "groups")
    ids = [g["group_id"] for g in groups["groups"] + groups["destroyed"]]
    return {
        "groups": groups,
        "accounts": await control(base_url, "accounts"),
        "messages": {g: await control(base_url, f"groups/{quote(g, safe='')}/messages") for g in ids},
        "notifications": {g: await control(base_url, f"groups/{quote(g, safe='')}/notifications") for g in ids},
        "c2c": await control(base_url, "c2c"),
    }


async def make_a_busy_state(im: TencentImClient) -> dict[str, int]:
    """Something of every kind the state holds; returns the MsgSeq of the AV messages by Random."""
    await im.multiaccount_import(["alice", "bob", "carol", "dave"])
    await im.account_import("erin", nick="Erin")
    await im.create_group(AV, "alice", "Friday night", "AVChatRoom")
    await im.create_group(PUBLIC, "alice", "Book club", "Public", deadline=None)
    await im.add_group_member(PUBLIC, ["bob", "carol", "dave"])
    await im.delete_group_member(PUBLIC, ["dave"])
    await im.forbid_send_msg(PUBLIC, ["bob"], 600)
    await im.ban_group_member(AV, ["carol"], 900)
    await im.send_group_system_notification(PUBLIC, "welcome", ["carol"])
    seqs = {}
    for random in (11, 22, 33):
        seqs[random] = (await im.send_group_msg(AV, f"message {random}", random=random)).msg_seq
    await im.send_group_msg(AV, "message 22", random=22)  # a quick re-send: absorbed, not stored
    await im.send_c2c_msg("bob", "hi bob", random=7, from_account="alice")
    await im.create_group("g-gone", "alice", "Short lived", "Public")
    await im.send_group_msg("g-gone", "bye", random=5)
    await im.destroy_group("g-gone")
    return seqs


async def test_state_survives_a_stop_and_start_on_the_same_dir(tmp_path: Path) -> None:
    async with sandbox_on(tmp_path) as (sandbox, im):
        seqs = await make_a_busy_state(im)
        before = await everything(sandbox.base_url)
    assert seqs == {11: 1, 22: 2, 33: 3}
    assert before["groups"]["groups"] and before["groups"]["destroyed"]  # the test is about something

    # another start on the same dir: another port, another process lifetime (a new secret key, too)
    async with sandbox_on(tmp_path, key="another-key") as (sandbox, im):
        after = await everything(sandbox.base_url)
        assert after == before
        assert sandbox.state.persistence() == {
            "path": str(state_file(tmp_path, APP)),
            "replayed": 17,  # the 17 calls above that changed the state (all of them did)
            "replay_failures": 0,
            "error": None,
        }
        # the duplicate window and the sequence continue where they were
        again = await im.send_group_msg(AV, "message 33", random=33)
        assert again.msg_seq == seqs[33]
        assert (await im.send_group_msg(AV, "message 44", random=44)).msg_seq == 4
        assert sandbox.state.group(AV) is not None and sandbox.state.group(AV).duplicates_absorbed == 2  # type: ignore[union-attr]
        # group rules hold as before: carol is still banned from the AV room, bob still muted
        with pytest.raises(ImPermanentError) as muted:
            await im.send_group_msg(PUBLIC, "from bob", random=1, from_account="bob")
        assert muted.value.code == 10017
        with pytest.raises(ImPermanentError) as dismissed:
            await im.send_group_msg("g-gone", "anyone?", random=6)
        assert dismissed.value.code == 10010
        with pytest.raises(ImPermanentError) as owned:  # the id is still alice's
            await im.create_group(AV, "alice", "Friday night", "AVChatRoom")
        assert owned.value.code == 10025


async def test_c2c_messages_and_their_duplicate_window_survive_a_restart(tmp_path: Path) -> None:
    async with sandbox_on(tmp_path) as (sandbox, im):
        await im.multiaccount_import(["kicked", "system"])
        first = await im.send_c2c_msg("kicked", "notice", random=5, msg_seq=6, from_account="system")
    async with sandbox_on(tmp_path) as (sandbox, im):
        # a retry after the restart, inside the 120 s window: still absorbed, still one message
        again = await im.send_c2c_msg("kicked", "notice", random=5, msg_seq=6, from_account="system")
        assert again == first
        [message] = (await control(sandbox.base_url, "c2c?to=kicked"))["messages"]
        assert (message["from_account"], message["msg_seq"], message["msg_random"], message["data"]) == (
            "system",
            6,
            5,
            "notice",
        )
        other = await im.send_c2c_msg("kicked", "notice", random=5, from_account="system")  # no MsgSeq: new
        assert other.msg_key != first.msg_key
    async with sandbox_on(tmp_path) as (sandbox, _im):
        messages = (await control(sandbox.base_url, "c2c?to=kicked"))["messages"]
        assert [m["msg_key"] for m in messages] == [first.msg_key, other.msg_key]  # replayed as answered


async def test_without_a_state_dir_a_restart_forgets(tmp_path: Path) -> None:
    async with sandbox_on(None) as (sandbox, im):
        await im.account_import("alice")
        await im.create_group(AV, "alice", "Friday night", "AVChatRoom")
        assert sandbox.state.persistence()["path"] is None
    async with sandbox_on(None) as (sandbox, im):
        assert (await control(sandbox.base_url, "groups"))["groups"] == []
    assert os.listdir(tmp_path) == []


async def test_the_state_file_is_private(tmp_path: Path) -> None:
    state_dir = tmp_path / "data"
    async with sandbox_on(state_dir) as (_sandbox, im):
        await im.account_import("alice")
        files = sorted(p.name for p in state_dir.iterdir())
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in state_dir.iterdir()}
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    assert files[0] == f"im-sandbox-{APP}.sqlite3"
    assert set(modes.values()) == {0o600}, modes  # the database and its WAL


async def test_reset_forgets_on_disk_too(tmp_path: Path) -> None:
    async with sandbox_on(tmp_path) as (sandbox, im):
        await make_a_busy_state(im)
        await control(sandbox.base_url, "reset", method="POST")
    async with sandbox_on(tmp_path) as (sandbox, im):
        assert (await control(sandbox.base_url, "groups")) == {"groups": [], "destroyed": []}
        assert (await control(sandbox.base_url, "accounts")) == {"accounts": []}
        assert sandbox.state.persistence()["replayed"] == 0


async def test_faults_and_the_request_log_are_not_state(tmp_path: Path) -> None:
    async with sandbox_on(tmp_path) as (sandbox, im):
        await im.account_import("alice")
        sandbox.state.inject_error("send_group_msg", 10002, count=None)
        sandbox.state.set_outage("http_503")
        sandbox.state.set_outage(None)
    async with sandbox_on(tmp_path) as (sandbox, im):
        assert sandbox.state.faults()["errors"] == []
        assert sandbox.state.requests == []
        assert "alice" in sandbox.state.accounts


async def test_a_dismissed_group_answers_10010_and_stays_dismissed_after_a_restart(tmp_path: Path) -> None:
    async with sandbox_on(tmp_path) as (sandbox, im):
        await im.account_import("alice")
        await im.create_group(AV, "alice", "Friday night", "AVChatRoom")
        await im.send_group_msg(AV, "one", random=1)
        dismissed = await control(sandbox.base_url, f"groups/{AV}/dismiss", method="POST")
        assert dismissed["destroyed"] is True and dismissed["message_count"] == 1
        with pytest.raises(ImPermanentError) as gone:
            await im.send_group_msg(AV, "two", random=2)
        assert gone.value.code == 10010
        async with httpx.AsyncClient(base_url=sandbox.base_url) as http:
            assert (await http.post("/_sandbox/groups/no-such/dismiss")).status_code == 404
    async with sandbox_on(tmp_path) as (sandbox, im):
        groups = await control(sandbox.base_url, "groups")
        assert groups["groups"] == [] and [g["group_id"] for g in groups["destroyed"]] == [AV]
        await im.create_group(AV, "alice", "Friday night", "AVChatRoom")  # the id is free again, as on Tencent
        assert (await im.send_group_msg(AV, "three", random=3)).msg_seq == 1


async def test_a_state_that_cannot_be_saved_answers_a_retryable_error_and_fails_healthz(tmp_path: Path) -> None:
    async with sandbox_on(tmp_path) as (sandbox, im):
        await im.account_import("alice")
        assert sandbox.state.journal is not None
        sandbox.state.journal.close()  # what a vanished disk looks like to the sandbox
        with pytest.raises(ImRetryableError) as failed:
            await im.account_import("bob")
        assert failed.value.code == 10002
        async with httpx.AsyncClient(base_url=sandbox.base_url) as http:
            health = await http.get("/_sandbox/healthz")
        assert health.status_code == 503 and "state not saved" in health.json()["error"]


async def test_a_state_of_another_app_is_refused(tmp_path: Path) -> None:
    SandboxJournal(state_file(tmp_path, APP), sdk_app_id=APP + 1).close()  # a file renamed by hand
    with pytest.raises(ValueError, match="sdk_app_id"):
        async with sandbox_on(tmp_path):
            pass


# --------------------------------------------------------------------------- a real process, killed


def start_cli(state_dir: Path, log: Path) -> subprocess.Popen[str]:
    command = ["im-sandbox", "--port", "0", "--sdk-app-id", str(APP), "--state-dir", str(state_dir)]
    return subprocess.Popen(
        [sys.executable, "-m", "roomservice.cli", *command],
        stdout=subprocess.PIPE,
        stderr=log.open("a"),
        text=True,
        env={**os.environ, "TENCENT_IM_SECRET_KEY": KEY, "PYTHONUNBUFFERED": "1"},
    )


def base_url_of(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:  # the command prints its URL once listening
        if line.startswith("http://"):
            return line.strip()
    raise AssertionError(f"the sandbox exited with {proc.wait()} before listening")


@pytest.mark.slow
async def test_a_killed_sandbox_process_loses_nothing_it_answered(tmp_path: Path) -> None:
    log = tmp_path / "sandbox.log"
    proc = start_cli(tmp_path, log)
    try:
        url = base_url_of(proc)
        async with client_for(url) as im:
            await im.account_import("alice")
            await im.create_group(AV, "alice", "Friday night", "AVChatRoom")
            answered = await asyncio.gather(*(im.send_group_msg(AV, f"m{i}", random=1000 + i) for i in range(50)))
        # one process at a time: a second one on the same dir refuses to start
        second = start_cli(tmp_path, tmp_path / "second.log")
        second.communicate(timeout=60)
        assert second.returncode == 1 and "in use by another process" in (tmp_path / "second.log").read_text()
    finally:
        proc.send_signal(signal.SIGKILL)  # no goodbyes: nothing is flushed or checkpointed on the way out
        proc.wait(timeout=10)
    assert f"{state_file(tmp_path, APP).name}-wal" in os.listdir(
        tmp_path
    )  # the WAL was not checkpointed: a crash indeed

    proc = start_cli(tmp_path, log)
    try:
        url = base_url_of(proc)
        messages = (await control(url, f"groups/{AV}/messages"))["messages"]
        assert sorted(m["msg_seq"] for m in messages) == sorted(a.msg_seq for a in answered) == list(range(1, 51))
        assert {m["random"]: m["data"] for m in messages} == {1000 + i: f"m{i}" for i in range(50)}
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


async def test_a_second_sandbox_in_the_same_process_cannot_open_the_state(tmp_path: Path) -> None:
    async with sandbox_on(tmp_path):
        with pytest.raises(SandboxStateInUse):
            async with sandbox_on(tmp_path):
                pass


async def test_an_answer_lost_after_the_work_was_done_over_http() -> None:
    """POST /_sandbox/lost_answers: the next call is applied, then answered 503 (the caller cannot tell)."""
    async with sandbox_on(None) as (sandbox, im):
        async with httpx.AsyncClient(base_url=sandbox.base_url) as http:
            answer = await http.post("/_sandbox/lost_answers", json={"command": "account_import", "count": 1})
            assert answer.status_code == 200 and answer.json()["lost_answers"] == {"account_import": 1}
        with pytest.raises(ImRetryableError):
            await im.account_import("alice")
        assert "alice" in sandbox.state.accounts  # imported, though the answer said otherwise
        await im.account_import("alice")  # the next answer arrives
        assert (await control(sandbox.base_url, "state"))["faults"]["lost_answers"] == {}
