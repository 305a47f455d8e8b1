"""The IM sandbox's durable state: an append-only journal of the calls that changed it.

The sandbox's state (accounts, groups with members, bans, mutes, messages and
notifications, one-to-one messages, id counters) is whatever the successful calls made
it. So instead of mapping every structure to tables, we keep those calls: each REST call
that changed the state (and each control that did, such as dismissing a group) is one
row — the sandbox clock at the call, the API, the identifier and the request JSON — and
starting replays the rows in order through the same handlers, with the clock pinned to
each row's time. The replayed state is the one that answered, by construction (the
handlers are deterministic given the state, the request and the time).

The file is SQLite (``<state_dir>/im-sandbox-<sdk_app_id>.sqlite3``, 0600, the dir
0700), in WAL mode with ``synchronous=NORMAL`` and an exclusive lock:

* a row is committed before the call's answer is sent (one small transaction, about
  15 µs: no fsync per commit in WAL mode with ``synchronous=NORMAL``), so a crash of the
  process (``kill -9``) loses nothing the sandbox answered;
* an OS crash or power cut may lose the transactions since the last WAL sync (SQLite
  syncs at checkpoints), never the file's consistency: the state comes back as it was
  at some earlier answered call;
* one process at a time: a second one opening the same file gets
  :class:`SandboxStateInUse` (two in-memory copies of one journal would diverge).

Not kept: injected faults, latency, the rate limit, the request log and the clock
offset (test controls, not state). ``reset`` empties the journal. The journal grows
like the in-memory state does (every message is kept in memory as well); replaying
100k rows takes about a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA_VERSION", "JournalEntry", "SandboxJournal", "SandboxStateInUse", "state_file"]

SCHEMA_VERSION = 1


class SandboxStateInUse(RuntimeError):
    """Another process holds the sandbox state file."""


@dataclass(frozen=True, slots=True)
class JournalEntry:
    seq: int
    at: float  # the sandbox clock when the call was handled
    service: str
    command: str
    identifier: str
    request: dict[str, Any]


def state_file(state_dir: str | os.PathLike[str], sdk_app_id: int) -> Path:
    """Where the state of app ``sdk_app_id`` lives under ``state_dir`` (one file per app:
    another app id is another IM app, with its own groups)."""
    return Path(state_dir) / f"im-sandbox-{sdk_app_id}.sqlite3"


class SandboxJournal:
    """The append-only call journal in one SQLite file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], *, sdk_app_id: int) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not self.path.exists():  # SQLite gives its WAL the main file's mode: create it private
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
        self._conn = sqlite3.connect(self.path, isolation_level=None, timeout=0, check_same_thread=False)
        try:
            self._conn.execute("PRAGMA locking_mode=EXCLUSIVE")
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            with self._transaction():
                self._conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
                self._conn.execute(
                    "CREATE TABLE IF NOT EXISTS journal (seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL,"
                    " service TEXT NOT NULL, command TEXT NOT NULL, identifier TEXT NOT NULL, request TEXT NOT NULL)"
                )
                self._check_meta("schema_version", str(SCHEMA_VERSION))
                self._check_meta("sdk_app_id", str(sdk_app_id))
        except sqlite3.OperationalError as exc:
            self._conn.close()
            if "locked" in str(exc) or "busy" in str(exc):
                raise SandboxStateInUse(
                    f"IM sandbox state {self.path} is in use by another process: one sandbox per state dir"
                    " (several processes: run `room-service im-sandbox` once and point them at it with"
                    " tencent_im.base_url)"
                ) from exc
            raise
        except BaseException:
            self._conn.close()
            raise

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def _check_meta(self, key: str, value: str) -> None:
        row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        if row is None:
            self._conn.execute("INSERT INTO meta (key, value) VALUES (?, ?)", (key, value))
        elif row[0] != value:
            raise ValueError(f"IM sandbox state {self.path} has {key} {row[0]}, expected {value}")

    def entries(self) -> Iterator[JournalEntry]:
        """Every row, oldest first."""
        cursor = self._conn.execute("SELECT seq, at, service, command, identifier, request FROM journal ORDER BY seq")
        for seq, at, service, command, identifier, request in cursor:
            yield JournalEntry(int(seq), float(at), service, command, identifier, json.loads(request))

    def __len__(self) -> int:
        return int(self._conn.execute("SELECT COUNT(*) FROM journal").fetchone()[0])

    def append(self, at: float, service: str, command: str, identifier: str, request: dict[str, Any]) -> None:
        """Commit one row (before the call is answered)."""
        text = json.dumps(request, separators=(",", ":"), ensure_ascii=False)
        with self._transaction():
            self._conn.execute(
                "INSERT INTO journal (at, service, command, identifier, request) VALUES (?, ?, ?, ?, ?)",
                (at, service, command, identifier, text),
            )

    def clear(self) -> None:
        with self._transaction():
            self._conn.execute("DELETE FROM journal")

    def close(self) -> None:
        self._conn.close()
