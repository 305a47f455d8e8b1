"""Initial schema: rooms, command log, snapshots, outbox, timers, wallet.

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Explicit DDL (this file never imports ``roomservice.store.tables``; column types come from the
frozen helpers in ``migrations/ddl.py``): it is the
schema as of this revision. Runs on SQLite and on MySQL/MariaDB (InnoDB,
utf8mb4; identifiers ASCII with a binary, case-sensitive collation).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from roomservice.store.migrations.ddl import MYSQL_TABLE as _MYSQL
from roomservice.store.migrations.ddl import ascii_id as _id
from roomservice.store.migrations.ddl import blob as _blob
from roomservice.store.migrations.ddl import json_text as _json
from roomservice.store.migrations.ddl import ms as _ms
from roomservice.store.migrations.ddl import pk_id as _pk_id

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "room_meta",
        sa.Column("app_code", _id(32), nullable=False),
        sa.Column("room_id", _id(48), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("lease_epoch", sa.BigInteger(), nullable=False),
        sa.Column("owner_id", _id(64), nullable=False),
        sa.Column("title", sa.String(64), nullable=False),
        sa.Column("status", _id(16), nullable=False),
        sa.Column("seat_count", sa.Integer(), nullable=False),
        sa.Column("member_count", sa.Integer(), nullable=False),
        sa.Column("heat", sa.BigInteger(), nullable=False),
        _ms("created_at_ms"),
        _ms("updated_at_ms"),
        sa.PrimaryKeyConstraint("app_code", "room_id"),
        **_MYSQL,
    )
    op.create_index("ix_room_meta_app_code_updated_at_ms", "room_meta", ["app_code", "updated_at_ms"])

    op.create_table(
        "room_command_log",
        _pk_id(),
        sa.Column("app_code", _id(32), nullable=False),
        sa.Column("room_id", _id(48), nullable=False),
        sa.Column("command_id", _id(64), nullable=False),
        sa.Column("command_type", _id(32), nullable=False),
        sa.Column("fingerprint", _id(64), nullable=False),
        sa.Column("command", _json(), nullable=False),
        sa.Column("events", _json(), nullable=False),
        sa.Column("response", _json(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        _ms("now_ms"),
        _ms("created_at_ms"),
        sa.UniqueConstraint(
            "app_code", "room_id", "command_id", name="uq_room_command_log_app_code_room_id_command_id"
        ),
        **_MYSQL,
    )
    op.create_index(
        "ix_room_command_log_app_code_room_id_version", "room_command_log", ["app_code", "room_id", "version"]
    )
    op.create_index("ix_room_command_log_created_at_ms", "room_command_log", ["created_at_ms"])

    op.create_table(
        "room_snapshot",
        sa.Column("app_code", _id(32), nullable=False),
        sa.Column("room_id", _id(48), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False, autoincrement=False),
        sa.Column("state", _json(), nullable=False),
        _ms("created_at_ms"),
        sa.PrimaryKeyConstraint("app_code", "room_id", "version"),
        **_MYSQL,
    )

    op.create_table(
        "room_outbox",
        _pk_id(),
        sa.Column("event_id", _id(64), nullable=False),
        sa.Column("app_code", _id(32), nullable=False),
        sa.Column("room_id", _id(48), nullable=False),
        sa.Column("room_version", sa.BigInteger(), nullable=False),
        sa.Column("event_type", _id(64), nullable=False),
        sa.Column("payload", _blob(), nullable=False),
        sa.Column("status", _id(16), nullable=False),
        sa.Column("retry_count", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("replay_count", sa.Integer(), nullable=False, server_default="0"),
        _ms("next_retry_at_ms", nullable=True),
        _ms("lock_until_ms", nullable=True),
        sa.Column("lock_owner", sa.String(128), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("targets_done", _id(255), nullable=False, server_default=""),
        _ms("due_at_ms"),
        _ms("created_at_ms"),
        _ms("updated_at_ms"),
        _ms("delivered_at_ms", nullable=True),
        sa.UniqueConstraint("event_id", name="uq_room_outbox_event_id"),
        sqlite_autoincrement=True,
        **_MYSQL,
    )
    op.create_index("ix_room_outbox_status_due_at_ms", "room_outbox", ["status", "due_at_ms"])
    op.create_index(
        "ix_room_outbox_app_code_room_id_room_version", "room_outbox", ["app_code", "room_id", "room_version"]
    )
    op.create_index("ix_room_outbox_event_type", "room_outbox", ["event_type"])
    op.create_index("ix_room_outbox_status_delivered_at_ms", "room_outbox", ["status", "delivered_at_ms"])

    op.create_table(
        "room_outbox_audit",
        _pk_id(),
        sa.Column("event_id", _id(64), nullable=False),
        sa.Column("action", _id(32), nullable=False),
        sa.Column("actor", sa.String(64), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        _ms("created_at_ms"),
        sqlite_autoincrement=True,
        **_MYSQL,
    )
    op.create_index("ix_room_outbox_audit_event_id", "room_outbox_audit", ["event_id"])

    op.create_table(
        "treasure_timer",
        sa.Column("app_code", _id(32), nullable=False),
        sa.Column("room_id", _id(48), nullable=False),
        sa.Column("box_id", _id(64), nullable=False),
        sa.Column("level", sa.Integer(), nullable=False),
        _ms("open_at_ms"),
        sa.Column("command_id", _id(64), nullable=False),
        sa.Column("status", _id(16), nullable=False),
        _ms("fire_at_ms"),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        _ms("lock_until_ms", nullable=True),
        sa.Column("lock_owner", sa.String(128), nullable=True),
        _ms("created_at_ms"),
        _ms("updated_at_ms"),
        sa.PrimaryKeyConstraint("app_code", "room_id", "box_id"),
        **_MYSQL,
    )
    op.create_index("ix_treasure_timer_status_fire_at_ms", "treasure_timer", ["status", "fire_at_ms"])

    op.create_table(
        "wallet_account",
        sa.Column("app_code", _id(32), nullable=False),
        sa.Column("user_id", _id(64), nullable=False),
        sa.Column("balance", sa.BigInteger(), nullable=False),
        _ms("updated_at_ms"),
        sa.PrimaryKeyConstraint("app_code", "user_id"),
        **_MYSQL,
    )

    op.create_table(
        "wallet_debit",
        sa.Column("debit_key", _id(200), nullable=False),
        sa.Column("app_code", _id(32), nullable=False),
        sa.Column("user_id", _id(64), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.Column("status", _id(16), nullable=False),
        _ms("created_at_ms"),
        _ms("updated_at_ms"),
        sa.PrimaryKeyConstraint("debit_key"),
        **_MYSQL,
    )
    op.create_index("ix_wallet_debit_status_created_at_ms", "wallet_debit", ["status", "created_at_ms"])

    op.create_table(
        "wallet_pending_debit",
        sa.Column("debit_key", _id(200), nullable=False),
        sa.Column("app_code", _id(32), nullable=False),
        sa.Column("room_id", _id(48), nullable=False),
        sa.Column("command_id", _id(64), nullable=False),
        sa.Column("user_id", _id(64), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        _ms("created_at_ms"),
        sa.PrimaryKeyConstraint("debit_key"),
        **_MYSQL,
    )
    op.create_index("ix_wallet_pending_debit_created_at_ms", "wallet_pending_debit", ["created_at_ms"])


def downgrade() -> None:
    for table in (
        "wallet_pending_debit",
        "wallet_debit",
        "wallet_account",
        "treasure_timer",
        "room_outbox_audit",
        "room_outbox",
        "room_snapshot",
        "room_command_log",
        "room_meta",
    ):
        op.drop_table(table)
