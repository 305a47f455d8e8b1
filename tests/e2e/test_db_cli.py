"""``room-service db upgrade`` says what it applied; the data dir and the database files are private."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from tests.e2e.server import ServerProcess

from roomservice.store.migrate import alembic_config, head_revision

pytestmark = pytest.mark.slow


def room_service(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "roomservice.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200"},
        timeout=120,
    )


def mode(path: Path) -> str:
    return oct(stat.S_IMODE(path.stat().st_mode))


def test_db_upgrade_prints_each_applied_revision_then_nothing_to_apply(tmp_path: Path) -> None:
    scripts = ScriptDirectory.from_config(alembic_config())
    oldest_first = list(reversed(list(scripts.walk_revisions())))
    assert len(oldest_first) >= 2

    first = room_service(tmp_path, "db", "upgrade")
    assert first.returncode == 0, first.stderr
    expected = [f"applied {s.revision}: {s.doc.strip()}" for s in oldest_first]
    assert first.stdout.splitlines() == [*expected, f"database is now at {head_revision()} (head)"]
    assert "up to date" not in first.stdout

    again = room_service(tmp_path, "db", "upgrade")
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [f"already at {head_revision()} (head): nothing to apply"]


def test_db_upgrade_creates_a_private_data_dir_and_database(tmp_path: Path) -> None:
    result = room_service(tmp_path, "db", "upgrade")
    assert result.returncode == 0, result.stderr
    assert mode(tmp_path / "var") == "0o700"
    assert mode(tmp_path / "var" / "room.db") == "0o600"


def test_a_world_readable_database_from_an_older_version_is_tightened(tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert room_service(tmp_path, "db", "upgrade", "--data-dir", str(data)).returncode == 0
    db_file = data / "room.db"
    db_file.chmod(0o644)
    result = room_service(tmp_path, "db", "upgrade", "--data-dir", str(data))
    assert result.returncode == 0, result.stderr
    assert mode(db_file) == "0o600"  # and SQLite gives -wal and -shm the database file's mode


def test_serve_keeps_the_database_and_its_wal_private(tmp_path: Path) -> None:
    # no --config and no --data-dir: ./var is the server's own creation
    server = ServerProcess(config=None, data_dir=tmp_path / "logs", cwd=tmp_path)
    server.start()
    try:
        var = tmp_path / "var"
        assert mode(var) == "0o700"
        files = sorted(p.name for p in var.iterdir() if p.name.startswith("room.db"))
        assert files == ["room.db", "room.db-shm", "room.db-wal"]  # WAL mode, while running
        assert {name: mode(var / name) for name in files} == dict.fromkeys(files, "0o600")
        assert mode(var / "admin-token") == "0o600"
        assert mode(var / "http-port") == "0o600"
    finally:
        server.stop()
