"""The relational schema as SQLAlchemy Core tables: the one definition queries are built from.

The migrations (``store/migrations/versions``) create exactly this schema with
explicit DDL; ``tests/contracts/test_room_store.py`` checks that the two agree.

Dialect notes:

* Identifier columns are ASCII with a binary collation on MySQL/MariaDB, whose
  default collation is case-insensitive ("Room1" and "room1" must be two rooms).
* JSON documents are text (MEDIUMTEXT on MySQL); every ``*_ms``, version,
  epoch and amount column is a BIGINT.
* Autoincrement ids are BIGINT on MySQL and ``INTEGER PRIMARY KEY`` (the rowid)
  on SQLite.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.types import TypeEngine

# One definition of each column type: the migrations' frozen helpers (see migrations/ddl.py).
from roomservice.store.migrations.ddl import MYSQL_TABLE, ascii_id, blob, json_text, ms

NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
}

# MySQL "mysql+..." and MariaDB-only "mariadb+..." URLs read differently prefixed options.
MYSQL_TABLE_OPTIONS: dict[str, Any] = MYSQL_TABLE

metadata = MetaData(naming_convention=NAMING_CONVENTION)


def autoincrement_id() -> TypeEngine[int]:
    return BigInteger().with_variant(Integer(), "sqlite")


_ms = ms


room_meta = Table(
    "room_meta",
    metadata,
    Column("app_code", ascii_id(32), primary_key=True),
    Column("room_id", ascii_id(48), primary_key=True),
    Column("version", BigInteger(), nullable=False),
    Column("lease_epoch", BigInteger(), nullable=False),
    Column("owner_id", ascii_id(64), nullable=False),
    Column("title", String(64), nullable=False),
    Column("status", ascii_id(16), nullable=False),
    Column("seat_count", Integer(), nullable=False),
    Column("member_count", Integer(), nullable=False),
    Column("heat", BigInteger(), nullable=False),
    _ms("created_at_ms"),
    _ms("updated_at_ms"),
    Index(None, "app_code", "updated_at_ms"),
    **MYSQL_TABLE_OPTIONS,
)

room_command_log = Table(
    "room_command_log",
    metadata,
    Column("id", autoincrement_id(), primary_key=True, autoincrement=True),
    Column("app_code", ascii_id(32), nullable=False),
    Column("room_id", ascii_id(48), nullable=False),
    Column("command_id", ascii_id(64), nullable=False),
    Column("command_type", ascii_id(32), nullable=False),
    Column("fingerprint", ascii_id(64), nullable=False),
    Column("command", json_text(), nullable=False),
    Column("events", json_text(), nullable=False),
    Column("response", json_text(), nullable=False),
    Column("version", BigInteger(), nullable=False),
    _ms("now_ms"),
    _ms("created_at_ms"),
    # the room_command_timing stages measured before the row was written (0005; None before it)
    Column("timing", json_text(), nullable=True),
    UniqueConstraint("app_code", "room_id", "command_id"),
    Index(None, "app_code", "room_id", "version"),
    Index(None, "created_at_ms"),
    **MYSQL_TABLE_OPTIONS,
)

room_snapshot = Table(
    "room_snapshot",
    metadata,
    Column("app_code", ascii_id(32), primary_key=True),
    Column("room_id", ascii_id(48), primary_key=True),
    Column("version", BigInteger(), primary_key=True, autoincrement=False),
    Column("state", json_text(), nullable=False),
    _ms("created_at_ms"),
    **MYSQL_TABLE_OPTIONS,
)

room_outbox = Table(
    "room_outbox",
    metadata,
    Column("id", autoincrement_id(), primary_key=True, autoincrement=True),
    Column("event_id", ascii_id(64), nullable=False),
    Column("app_code", ascii_id(32), nullable=False),
    Column("room_id", ascii_id(48), nullable=False),
    Column("room_version", BigInteger(), nullable=False),
    Column("event_type", ascii_id(64), nullable=False),
    Column("payload", blob(), nullable=False),
    Column("status", ascii_id(16), nullable=False),
    Column("retry_count", Integer(), nullable=False, server_default="0"),
    Column("replay_count", Integer(), nullable=False, server_default="0"),
    _ms("next_retry_at_ms", nullable=True),
    _ms("lock_until_ms", nullable=True),
    Column("lock_owner", String(128), nullable=True),
    Column("last_error", Text(), nullable=True),
    # Comma-separated names of the targets that already succeeded for this row.
    Column("targets_done", ascii_id(255), nullable=False, server_default=""),
    # The claim key: pending -> created_at_ms, retryable -> next_retry_at_ms,
    # delivering -> lock_until_ms; one index serves every claimable status.
    _ms("due_at_ms"),
    _ms("created_at_ms"),
    _ms("updated_at_ms"),
    _ms("delivered_at_ms", nullable=True),
    # The W3C traceparent of the command that wrote the row (tracing on; migration 0006).
    Column("trace_context", ascii_id(64), nullable=True),
    UniqueConstraint("event_id"),
    Index(None, "status", "due_at_ms"),
    Index(None, "app_code", "room_id", "room_version"),
    Index(None, "event_type"),
    Index(None, "status", "delivered_at_ms"),
    sqlite_autoincrement=True,
    **MYSQL_TABLE_OPTIONS,
)

room_outbox_audit = Table(
    "room_outbox_audit",
    metadata,
    Column("id", autoincrement_id(), primary_key=True, autoincrement=True),
    Column("event_id", ascii_id(64), nullable=False),
    Column("action", ascii_id(32), nullable=False),
    Column("actor", String(64), nullable=False),
    Column("detail", Text(), nullable=True),
    _ms("created_at_ms"),
    Index(None, "event_id"),
    sqlite_autoincrement=True,
    **MYSQL_TABLE_OPTIONS,
)

treasure_timer = Table(
    "treasure_timer",
    metadata,
    Column("app_code", ascii_id(32), primary_key=True),
    Column("room_id", ascii_id(48), primary_key=True),
    Column("box_id", ascii_id(64), primary_key=True),
    Column("level", Integer(), nullable=False),
    _ms("open_at_ms"),
    Column("command_id", ascii_id(64), nullable=False),
    Column("status", ascii_id(16), nullable=False),
    _ms("fire_at_ms"),
    Column("attempts", Integer(), nullable=False, server_default="0"),
    _ms("lock_until_ms", nullable=True),
    Column("lock_owner", String(128), nullable=True),
    _ms("created_at_ms"),
    _ms("updated_at_ms"),
    Index(None, "status", "fire_at_ms"),
    **MYSQL_TABLE_OPTIONS,
)

wallet_account = Table(
    "wallet_account",
    metadata,
    Column("app_code", ascii_id(32), primary_key=True),
    Column("user_id", ascii_id(64), primary_key=True),
    Column("balance", BigInteger(), nullable=False),
    _ms("updated_at_ms"),
    **MYSQL_TABLE_OPTIONS,
)

wallet_debit = Table(
    "wallet_debit",
    metadata,
    Column("debit_key", ascii_id(200), primary_key=True),
    Column("app_code", ascii_id(32), nullable=False),
    Column("user_id", ascii_id(64), nullable=False),
    Column("amount", BigInteger(), nullable=False),
    Column("status", ascii_id(16), nullable=False),
    _ms("created_at_ms"),
    _ms("updated_at_ms"),
    Index(None, "status", "created_at_ms"),
    **MYSQL_TABLE_OPTIONS,
)

wallet_pending_debit = Table(
    "wallet_pending_debit",
    metadata,
    Column("debit_key", ascii_id(200), primary_key=True),
    Column("app_code", ascii_id(32), nullable=False),
    Column("room_id", ascii_id(48), nullable=False),
    Column("command_id", ascii_id(64), nullable=False),
    Column("user_id", ascii_id(64), nullable=False),
    Column("amount", BigInteger(), nullable=False),
    _ms("created_at_ms"),
    Index(None, "created_at_ms"),
    **MYSQL_TABLE_OPTIONS,
)

# --------------------------------------------------------------------------- direct delivery (0002)

im_sent_event = Table(
    "im_sent_event",
    metadata,
    Column("event_id", ascii_id(64), primary_key=True),
    Column("group_id", ascii_id(128), nullable=False),
    Column("operation", ascii_id(32), primary_key=True),
    _ms("sent_at_ms"),
    Index(None, "sent_at_ms"),
    Index(None, "group_id", "operation"),  # "was this group destroyed?"
    **MYSQL_TABLE_OPTIONS,
)

activity_processed_event = Table(
    "activity_processed_event",
    metadata,
    Column("event_id", ascii_id(64), primary_key=True),
    Column("event_type", ascii_id(64), nullable=False),
    _ms("processed_at_ms"),
    Index(None, "processed_at_ms"),
    **MYSQL_TABLE_OPTIONS,
)

activity_gift_board = Table(
    "activity_gift_board",
    metadata,
    Column("app_code", ascii_id(32), primary_key=True),
    Column("room_id", ascii_id(48), primary_key=True),
    Column("day", Integer(), primary_key=True, autoincrement=False),
    Column("board", ascii_id(16), primary_key=True),  # "sent" | "received"
    Column("user_id", ascii_id(64), primary_key=True),
    Column("value", BigInteger(), nullable=False),
    _ms("updated_at_ms"),
    Index(None, "app_code", "room_id", "day", "board", "value"),
    **MYSQL_TABLE_OPTIONS,
)

activity_treasure_reward = Table(
    "activity_treasure_reward",
    metadata,
    Column("app_code", ascii_id(32), primary_key=True),
    Column("room_id", ascii_id(48), primary_key=True),
    Column("box_id", ascii_id(64), primary_key=True),
    Column("user_id", ascii_id(64), primary_key=True),
    Column("level", Integer(), nullable=False),
    Column("event_id", ascii_id(64), nullable=False),
    _ms("created_at_ms"),
    **MYSQL_TABLE_OPTIONS,
)

# --------------------------------------------------------------------------- embedded broker (0003)

broker_message = Table(
    "broker_message",
    metadata,
    Column("id", autoincrement_id(), primary_key=True, autoincrement=True),
    Column("topic", ascii_id(128), nullable=False),
    Column("msg_key", ascii_id(128), nullable=False),
    Column("tag", String(255), nullable=False),
    Column("sharding_key", String(255), nullable=False),
    Column("headers", json_text(), nullable=False),
    Column("body", blob(), nullable=False),
    _ms("deliver_at_ms", nullable=True),
    _ms("published_at_ms"),
    UniqueConstraint("topic", "msg_key"),
    sqlite_autoincrement=True,
    **MYSQL_TABLE_OPTIONS,
)

broker_group = Table(
    "broker_group",
    metadata,
    Column("group_name", ascii_id(128), primary_key=True),
    Column("topic", ascii_id(128), nullable=False),
    Column("max_deliveries", Integer(), nullable=False),
    _ms("created_at_ms"),
    Index(None, "topic"),
    **MYSQL_TABLE_OPTIONS,
)

broker_delivery = Table(
    "broker_delivery",
    metadata,
    Column("group_name", ascii_id(128), primary_key=True),
    Column(
        "message_id",
        autoincrement_id(),
        ForeignKey("broker_message.id", name="fk_broker_delivery_message_id"),
        primary_key=True,
        autoincrement=False,
    ),
    Column("state", ascii_id(8), nullable=False),  # "ready" | "dead"
    Column("delivery_count", Integer(), nullable=False),
    _ms("visible_at_ms"),  # ready: held or in flight until then; dead: when it died
    Column("receipt", ascii_id(32), nullable=True),  # the current delivery's; NULL while never handed out
    Column("last_error", Text(), nullable=True),
    _ms("dead_at_ms", nullable=True),
    Index(None, "group_name", "state", "visible_at_ms", "message_id"),
    Index(None, "state", "visible_at_ms"),
    Index(None, "message_id"),
    **MYSQL_TABLE_OPTIONS,
)

# --------------------------------------------------------------------------- notice consumer (0004)

notice_delivery_events = Table(
    "notice_delivery_events",
    metadata,
    Column("event_id", ascii_id(64), primary_key=True),  # dedup_id of the event: a repair shares the row
    Column("app_code", ascii_id(32), nullable=False),
    Column("room_id", ascii_id(48), nullable=False),
    Column("user_id", ascii_id(64), nullable=False),  # who gets the notice (the kicked user)
    Column("im_account", ascii_id(32), nullable=False),  # their IM account (account_id_for)
    Column("kind", ascii_id(16), nullable=False),  # "kicked"
    Column("status", ascii_id(8), nullable=False),  # "pending" | "sent" | "failed"
    Column("attempts", Integer(), nullable=False),  # IM send attempts that ended (success or error)
    Column("last_error", Text(), nullable=True),
    Column("payload", json_text(), nullable=False),  # the C2C message's Data, exactly as sent
    Column("msg_key", String(128), nullable=True),  # Tencent's MsgKey once sent
    _ms("created_at_ms"),
    _ms("updated_at_ms"),
    _ms("sent_at_ms", nullable=True),
    Index(None, "status", "updated_at_ms"),
    Index(None, "app_code", "user_id"),
    **MYSQL_TABLE_OPTIONS,
)
