"""``room-service outbox …`` as a real subprocess against a temporary SQLite database."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tests.service.test_outbox_admin import HOUR, MIN, gift_event, insert_rows, join_event, outbox_row

from roomservice.store.database import Database
from roomservice.store.migrate import upgrade

REPO = Path(__file__).resolve().parents[2]
ACTOR = "cli-tester"


@dataclass
class Env:
    tmp: Path
    config: Path
    db_path: Path

    def run(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "USER": ACTOR, "COLUMNS": "200", "NO_COLOR": "1"}
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "roomservice.cli",
                "outbox",
                *args,
                "--config",
                str(self.config),
                "--data-dir",
                str(self.tmp),
            ],
            capture_output=True,
            text=True,
            input=input,
            env=env,
            cwd=self.tmp,
            timeout=60,
        )

    def row(self, event_id: str) -> dict[str, Any]:
        with sqlite3.connect(self.db_path) as conn:
            conn.row_factory = sqlite3.Row
            row = conn.execute("SELECT * FROM room_outbox WHERE event_id = ?", (event_id,)).fetchone()
        assert row is not None, event_id
        return dict(row)

    def audit(self, event_id: str) -> list[dict[str, Any]]:
        with sqlite3.connect(self.db_path) as conn:
            conn.row_factory = sqlite3.Row
            rows = conn.execute(
                "SELECT * FROM room_outbox_audit WHERE event_id = ? ORDER BY id", (event_id,)
            ).fetchall()
        return [dict(r) for r in rows]

    def statuses(self) -> dict[str, int]:
        with sqlite3.connect(self.db_path) as conn:
            return dict(conn.execute("SELECT status, count(*) FROM room_outbox GROUP BY status").fetchall())


def seed_rows(now_ms: int) -> list[dict[str, Any]]:
    return [
        outbox_row(join_event("p-old"), created_at_ms=now_ms - 10 * MIN),
        outbox_row(gift_event("r-1"), status="retryable", created_at_ms=now_ms - 30 * MIN, retry_count=2,
                   next_retry_at_ms=now_ms + HOUR, last_error="Timeout talking to IM"),
        outbox_row(gift_event("d-1", room="r2"), status="delivered", created_at_ms=now_ms - 3 * HOUR),
        outbox_row(gift_event("f-1"), status="failed", created_at_ms=now_ms - 2 * HOUR, retry_count=10,
                   last_error="IM: HTTP 500 Internal Server Error", targets_done="activity"),
        outbox_row(join_event("f-2", room="r2"), status="failed", created_at_ms=now_ms - 5 * MIN, retry_count=3,
                   last_error="permanent: bad payload"),
        outbox_row(gift_event("legacy-1"), status="published", created_at_ms=now_ms - 5 * HOUR),
        *[
            outbox_row(gift_event(f"bulk-{i}", room="r9"), status="failed", created_at_ms=now_ms - HOUR,
                       retry_count=10, last_error="activity: unavailable")
            for i in range(5)
        ],
    ]  # fmt: skip


@pytest.fixture
def cli(tmp_path: Path) -> Env:
    db_path = tmp_path / "room.db"
    url = f"sqlite+aiosqlite:///{db_path}"
    config = tmp_path / "room.yaml"
    config.write_text(f'database:\n  url: "{url}"\nlogging:\n  json: false\n')

    async def seed() -> None:
        db = Database.from_url(url)
        try:
            await upgrade(db)
            await insert_rows(db, seed_rows(time.time_ns() // 1_000_000))
        finally:
            await db.dispose()

    asyncio.run(seed())
    return Env(tmp=tmp_path, config=config, db_path=db_path)


def assert_clear_error(result: subprocess.CompletedProcess[str], fragment: str, code: int = 2) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def listed(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 0, result.stderr
    return [r["event_id"] for r in json.loads(result.stdout)]


# --------------------------------------------------------------------------- reads


def test_stats(cli: Env) -> None:
    result = cli.run("stats")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for word in ("pending", "delivering", "delivered", "retryable", "failed", "published (legacy)"):
        assert word in out
    assert "room_outbox: 11 row(s)" in out
    assert "oldest pending: 10m" in out
    assert "oldest retryable: 30m" in out

    body = json.loads(cli.run("stats", "--json").stdout)
    assert body["counts"] == {
        "pending": 1,
        "delivering": 0,
        "delivered": 1,
        "retryable": 1,
        "failed": 7,
        "published": 1,
    }
    assert body["total"] == 11
    assert 10 * MIN <= body["oldest_pending_age_ms"] < 11 * MIN


def test_list_and_filters(cli: Env) -> None:
    table = cli.run("list", "--status", "failed")
    assert table.returncode == 0, table.stderr
    assert "f-1" in table.stdout and "f-2" in table.stdout and "bulk-4" in table.stdout
    assert "p-old" not in table.stdout
    assert "IM: HTTP 500 Internal Server Error" in table.stdout
    assert "7 row(s)" in table.stdout

    assert listed(cli.run("list", "--json", "--status", "failed", "--type", "RoomUserJoined")) == ["f-2"]
    assert listed(cli.run("list", "--json", "--status", "pending", "--status", "retryable")) == ["p-old", "r-1"]
    assert listed(cli.run("list", "--json", "--room", "r2")) == ["d-1", "f-2"]
    assert listed(cli.run("list", "--json", "--older-than", "90m")) == ["d-1", "f-1", "legacy-1"]
    assert listed(cli.run("list", "--json", "--newer-than", "20m")) == ["p-old", "f-2"]
    assert listed(cli.run("list", "--json", "--error", "http 500")) == ["f-1"]
    assert listed(cli.run("list", "--json", "--status", "failed", "--room", "r9", "--limit", "2")) == [
        "bulk-0",
        "bulk-1",
    ]
    paged = cli.run("list", "--status", "failed", "--room", "r9", "--limit", "2")
    assert "more may follow: --after-id" in paged.stdout
    assert "no matching rows" in cli.run("list", "--app", "nobody").stdout


def test_show(cli: Env) -> None:
    result = cli.run("show", "f-1")
    assert result.returncode == 0, result.stderr
    for text in ("f-1", "failed", "RoomGiftSent", "IM: HTTP 500 Internal Server Error", "total_value", "activity"):
        assert text in result.stdout, text
    assert "audit: none" in result.stdout

    body = json.loads(cli.run("show", "f-1", "--json").stdout)
    assert body["event"]["event_id"] == "f-1"
    assert body["event"]["payload"]["gift_id"] == "rose"
    assert body["retry_count"] == 10


# --------------------------------------------------------------------------- replay


def test_replay_single_keeps_event_id(cli: Env) -> None:
    before = cli.row("f-1")
    result = cli.run("replay", "f-1")
    assert result.returncode == 0, result.stderr
    assert "replayed: f-1 requeued" in result.stdout
    after = cli.row("f-1")
    assert after["id"] == before["id"]
    assert after["event_id"] == "f-1"
    assert after["status"] == "pending"
    assert (after["retry_count"], after["replay_count"]) == (0, 1)
    assert after["targets_done"] == "activity"
    assert after["payload"] == before["payload"]
    (audit,) = cli.audit("f-1")
    assert (audit["action"], audit["actor"]) == ("replay", ACTOR)
    assert json.loads(audit["detail"])["previous_last_error"] == "IM: HTTP 500 Internal Server Error"

    shown = cli.run("show", "f-1")
    assert "replay" in shown.stdout and ACTOR in shown.stdout


def test_replay_reports_rows_that_are_not_failed(cli: Env) -> None:
    result = cli.run("replay", "d-1", "f-2")
    assert result.returncode == 1
    assert "not_failed: d-1 is delivered, not failed" in result.stdout
    assert "replayed: f-2 requeued" in result.stdout
    assert cli.row("d-1")["status"] == "delivered"
    assert cli.row("f-2")["status"] == "pending"


def test_replay_unknown_id(cli: Env) -> None:
    assert_clear_error(cli.run("replay", "nope"), "no outbox row with event_id nope")
    assert cli.statuses()["failed"] == 7


def test_replay_of_a_known_and_an_unknown_id_is_a_partial_outcome_not_a_bad_argument(cli: Env) -> None:
    """Exit 2 says nothing happened; here f-1 was replayed for good, so a script must not read it that way."""
    result = cli.run("replay", "f-1", "nope")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "replayed: f-1 requeued" in result.stdout
    assert "replayed 1; no outbox row with event_id nope" in result.stderr
    assert cli.row("f-1")["status"] == "pending"


def test_bulk_replay_with_progress(cli: Env) -> None:
    result = cli.run("replay", "--status", "failed", "--room", "r9", "--yes")
    assert result.returncode == 0, result.stderr
    assert "replayed 5 of 5 failed row(s)" in result.stdout
    assert "5/5" in result.stderr  # the progress bar's final state
    for i in range(5):
        row = cli.row(f"bulk-{i}")
        assert (row["event_id"], row["status"], row["retry_count"], row["replay_count"]) == (
            f"bulk-{i}",
            "pending",
            0,
            1,
        )
    assert cli.row("f-1")["status"] == "failed"


def test_bulk_replay_asks_for_confirmation(cli: Env) -> None:
    declined = cli.run("replay", "--status", "failed", "--error", "unavailable", input="n\n")
    assert declined.returncode == 1
    assert "replay 5 failed row(s)?" in declined.stderr
    assert "aborted" in declined.stderr
    assert cli.statuses()["failed"] == 7

    accepted = cli.run("replay", "--status", "failed", "--error", "unavailable", input="y\n")
    assert accepted.returncode == 0, accepted.stderr
    assert cli.statuses()["failed"] == 2


def test_bulk_replay_as_repair(cli: Env) -> None:
    result = cli.run("replay", "--status", "failed", "--type", "RoomUserJoined", "--as-repair", "--yes", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["replayed"] == 1
    (outcome,) = report["results"]
    assert outcome["event_id"] == "f-2"
    new_id = outcome["new_event_id"]
    assert cli.row("f-2")["status"] == "failed"
    assert cli.row(new_id)["status"] == "pending"
    assert [a["action"] for a in cli.audit("f-2")] == ["repair"]
    assert [a["action"] for a in cli.audit(new_id)] == ["repair_of"]
    shown = json.loads(cli.run("show", new_id, "--json").stdout)
    assert shown["event"]["event_id"] == new_id


def test_bulk_replay_with_no_match(cli: Env) -> None:
    result = cli.run("replay", "--status", "failed", "--room", "nowhere")
    assert result.returncode == 0, result.stderr
    assert "no failed rows match" in result.stdout


# --------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("replay",), "nothing to replay: give EVENT_ID... or --status failed"),
        (("replay", "--room", "r9"), "nothing to replay"),
        (("replay", "--status", "pending"), "replay takes only --status failed"),
        (("replay", "f-1", "--status", "failed"), "not both"),
        (("replay", "--status", "failed", "--older-than", "10"), "--older-than: duration '10' is missing a unit"),
        (("list", "--older-than", "ten minutes"), "--older-than: invalid duration"),
        (("list", "--newer-than", "5x"), "--newer-than: unknown unit"),
        (("list", "--status", "dead"), "unknown status 'dead'; expected one of pending"),
        (("list", "--limit", "0"), "limit must be 1..1000"),
        (("show", "nope"), "no outbox row with event_id nope"),
        (("show", "\u00e9"), "EVENT_ID: '\u00e9' is not an event id (must match ^[A-Za-z0-9_.:-]{1,64}$)"),
        (("replay", "f-1", "f-\u00e9"), "EVENT_ID: 'f-\u00e9' is not an event id"),  # f-1 is not replayed either
        (("list", "--type", "\u00e9"), "--type: '\u00e9' does not match"),
        (("list", "--app", "Demo"), "--app: 'Demo' does not match ^[a-z0-9_]{1,32}$"),
        (("list", "--room", "r 1"), "--room: 'r 1' does not match"),
        (("replay", "--status", "failed", "--room", "r\u00e9", "--yes"), "--room: 'r\u00e9' does not match"),
    ],
)
def test_bad_arguments_fail_with_one_clear_line(cli: Env, args: tuple[str, ...], fragment: str) -> None:
    assert_clear_error(cli.run(*args), fragment)
    assert cli.statuses()["failed"] == 7


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("show", "\u00e9"), "EVENT_ID: '\u00e9' is not an event id"),
        (("replay", "f-1", "\u00e9"), "EVENT_ID: '\u00e9' is not an event id"),
        (("list", "--type", "\u00e9"), "--type"),
        (("list", "--app", "\u00e9"), "--app"),
        (("list", "--room", "\u00e9"), "--room"),
        (("replay", "--status", "failed", "--app", "\u00e9", "--yes"), "--app"),
    ],
)
def test_ids_outside_their_patterns_are_bad_arguments_on_mariadb(
    tmp_path: Path, migrated_mariadb_url: str, args: tuple[str, ...], fragment: str
) -> None:
    # MariaDB cannot compare an ascii_bin column with a non-ASCII literal (errors 1267/1270): this
    # printed "database unavailable" and exited 1, as if the database were down
    config = tmp_path / "room.yaml"
    config.write_text(f'database:\n  url: "{migrated_mariadb_url}"\nlogging:\n  json: false\n')

    async def seed() -> None:
        db = Database.from_url(migrated_mariadb_url)
        try:
            await insert_rows(db, seed_rows(time.time_ns() // 1_000_000))
        finally:
            await db.dispose()

    asyncio.run(seed())
    env = Env(tmp=tmp_path, config=config, db_path=tmp_path / "unused.db")
    assert_clear_error(env.run(*args), fragment)
    shown = env.run("show", "f-1", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["status"] == "failed"


# --------------------------------------------------------------------------- no database


def run_outbox_bare(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``room-service outbox …`` with no --config: the packaged default, SQLite under the data dir."""
    return subprocess.run(
        [sys.executable, "-m", "roomservice.cli", "outbox", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "USER": ACTOR, "COLUMNS": "200", "NO_COLOR": "1"},
        cwd=cwd,
        timeout=60,
    )


@pytest.mark.parametrize(
    "args",
    [("stats",), ("stats", "--json"), ("list",), ("show", "e-1"), ("replay", "e-1"), ("replay", "--status", "failed")],
    ids=lambda a: " ".join(a),
)
def test_read_only_commands_refuse_a_missing_database_and_create_nothing(tmp_path: Path, args: tuple[str, ...]) -> None:
    result = run_outbox_bare(tmp_path, *args)
    assert_clear_error(result, f"no database at {tmp_path / 'var' / 'room.db'}")
    assert list(tmp_path.iterdir()) == []  # no ./var, no room.db

    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_outbox_bare(tmp_path, *args, "--data-dir", str(empty))
    assert_clear_error(result, f"no database at {empty / 'room.db'}")
    assert list(empty.iterdir()) == []


@pytest.mark.parametrize("args", [("stats",), ("list",), ("show", "e-1"), ("replay", "e-1")], ids=lambda a: " ".join(a))
def test_a_database_without_the_schema_is_not_migrated_by_an_admin_command(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    """An admin command of a newer release must not upgrade the schema under the servers running on it."""
    data = tmp_path / "data"
    data.mkdir()
    sqlite3.connect(data / "room.db").close()  # a database, never migrated
    result = run_outbox_bare(tmp_path, *args, "--data-dir", str(data))
    assert_clear_error(result, "is the database migrated? room-service db upgrade", code=1)
    with sqlite3.connect(data / "room.db") as conn:
        assert conn.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)


def test_a_configured_database_file_that_does_not_exist_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "elsewhere" / "room.db"
    config = tmp_path / "room.yaml"
    config.write_text(f'database:\n  url: "sqlite+aiosqlite:///{missing}"\n')
    result = run_outbox_bare(tmp_path, "stats", "--config", str(config))
    assert_clear_error(result, f"no database at {missing}")
    assert not (tmp_path / "elsewhere").exists()
