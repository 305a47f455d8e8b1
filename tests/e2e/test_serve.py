"""`room-service serve` as users run it: readiness, the generated admin token, the outbox admin API."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from tests.e2e.server import ServerProcess, write_config

pytestmark = pytest.mark.slow


def test_serve_reports_ready_and_guards_the_admin_api(tmp_path: Path) -> None:
    server = ServerProcess(config=write_config(tmp_path / "c.yaml"), data_dir=tmp_path / "data")
    server.start()
    try:
        ready = httpx.get(f"{server.url}/readyz").json()
        assert ready["ready"] is True
        assert set(ready["checks"]) >= {"database", "outbox_worker"}
        token = (tmp_path / "data" / "admin-token").read_text().strip()
        assert len(token) >= 32
        assert oct((tmp_path / "data" / "admin-token").stat().st_mode & 0o777) == "0o600"
        httpx.post(
            f"{server.url}/v1/apps/demo/rooms",
            json={"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "t"},
        ).raise_for_status()
        denied = httpx.get(f"{server.url}/admin/outbox/stats")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "unauthorized"
        stats = httpx.get(f"{server.url}/admin/outbox/stats", headers={"Authorization": f"Bearer {token}"})
        assert stats.status_code == 200
        assert stats.json()["total"] == 1  # the RoomCreated row
    finally:
        server.stop()
    # the token survives a restart
    server.start()
    try:
        again = httpx.get(f"{server.url}/admin/outbox/stats", headers={"Authorization": f"Bearer {token}"})
        assert again.status_code == 200
    finally:
        server.stop()


def test_serve_without_config_runs_the_packaged_default_from_any_directory(tmp_path: Path) -> None:
    server = ServerProcess(config=None, data_dir=tmp_path / "var", cwd=tmp_path)
    server.start()
    try:
        gifts = httpx.get(f"{server.url}/v1/gifts").json()
        assert len(gifts) >= 5  # the packaged local.yaml's catalog
        assert (tmp_path / "var" / "room.db").is_file()  # ./var relative to the working directory
        assert (tmp_path / "var" / "admin-token").is_file()
    finally:
        server.stop()


def test_serve_shows_its_consumer_groups_on_the_admin_api(tmp_path: Path) -> None:
    """GET /admin/consumers on the embedded default: every group's lag and dead letters from the
    broker beside what this process's own groups did, behind the admin token."""
    server = ServerProcess(config=None, data_dir=tmp_path / "var", cwd=tmp_path)
    server.start()
    try:
        token = (tmp_path / "var" / "admin-token").read_text().strip()
        auth = {"Authorization": f"Bearer {token}"}
        assert httpx.get(f"{server.url}/admin/consumers").status_code == 401
        httpx.post(
            f"{server.url}/v1/apps/demo/rooms",
            json={"command_id": "c1", "room_id": "r1", "owner_id": "alice", "title": "t"},
        ).raise_for_status()
        httpx.post(
            f"{server.url}/v1/apps/demo/rooms/r1/join", json={"command_id": "c2", "user_id": "bob"}
        ).raise_for_status()
        deadline = time.monotonic() + 20
        while True:  # until every group has taken both events (RoomCreated, RoomUserJoined) off the broker
            body = httpx.get(f"{server.url}/admin/consumers", headers=auth).json()
            outbox_groups = [g for g in body["groups"] if g["topic"] == "hyapp_room_outbox"]
            done = [g["this_process"]["applied"] + g["this_process"]["duplicates"] for g in outbox_groups]
            if outbox_groups and all(n >= 2 for n in done) and all(g["lag"] == 0 for g in body["groups"]):
                break
            assert time.monotonic() < deadline, body
            time.sleep(0.1)
        assert body["broker"] == "embedded"
        names = {g["group"] for g in body["groups"]}
        assert {"hyapp-activity-room-outbox", "hyapp-room-im-bridge", "hyapp-room-treasure-open"} <= names
        for group in body["groups"]:
            assert group["error"] is None and group["dead_letters"] == 0 and group["in_flight"] == 0
            assert group["this_process"]["running"] is True and group["this_process"]["failures"] == 0
    finally:
        server.stop()
