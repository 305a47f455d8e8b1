"""Embedded broker: messages, consumer groups and each group's deliveries.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

The embedded broker (``roomservice.brokers.embedded``) keeps its queue in the
service's own database. ``broker_message`` holds each message once per
(topic, key) for as long as it is retained; ``broker_group`` the declared
consumer groups; ``broker_delivery`` one row per (group, message) the group has
not acknowledged yet — ready (held until ``visible_at_ms``, or in flight with a
receipt) or dead (the group's dead letter). An ack deletes the row.
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

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "broker_message",
        _pk_id(),
        sa.Column("topic", _id(128), nullable=False),
        sa.Column("msg_key", _id(128), nullable=False),
        sa.Column("tag", sa.String(255), nullable=False),
        sa.Column("sharding_key", sa.String(255), nullable=False),
        sa.Column("headers", _json(), nullable=False),
        sa.Column("body", _blob(), nullable=False),
        _ms("deliver_at_ms", nullable=True),
        _ms("published_at_ms"),
        sa.UniqueConstraint("topic", "msg_key", name="uq_broker_message_topic_msg_key"),
        sqlite_autoincrement=True,
        **_MYSQL,
    )

    op.create_table(
        "broker_group",
        sa.Column("group_name", _id(128), nullable=False),
        sa.Column("topic", _id(128), nullable=False),
        sa.Column("max_deliveries", sa.Integer(), nullable=False),
        _ms("created_at_ms"),
        sa.PrimaryKeyConstraint("group_name"),
        **_MYSQL,
    )
    op.create_index("ix_broker_group_topic", "broker_group", ["topic"])

    op.create_table(
        "broker_delivery",
        sa.Column("group_name", _id(128), nullable=False),
        sa.Column("message_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("state", _id(8), nullable=False),
        sa.Column("delivery_count", sa.Integer(), nullable=False),
        _ms("visible_at_ms"),
        sa.Column("receipt", _id(32), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        _ms("dead_at_ms", nullable=True),
        sa.PrimaryKeyConstraint("group_name", "message_id"),
        sa.ForeignKeyConstraint(["message_id"], ["broker_message.id"], name="fk_broker_delivery_message_id"),
        **_MYSQL,
    )
    # The claim (a group's ready rows by visible_at_ms) and the dead letters (its dead rows).
    op.create_index(
        "ix_broker_delivery_group_name_state_visible_at_ms_message_id",
        "broker_delivery",
        ["group_name", "state", "visible_at_ms", "message_id"],
    )
    # Retention: expired rows of every group, ready or dead.
    op.create_index("ix_broker_delivery_state_visible_at_ms", "broker_delivery", ["state", "visible_at_ms"])
    # "Does any group still need this message?" (and the foreign key's index on MySQL).
    op.create_index("ix_broker_delivery_message_id", "broker_delivery", ["message_id"])


def downgrade() -> None:
    op.drop_index("ix_broker_delivery_message_id", table_name="broker_delivery")
    op.drop_index("ix_broker_delivery_state_visible_at_ms", table_name="broker_delivery")
    op.drop_index("ix_broker_delivery_group_name_state_visible_at_ms_message_id", table_name="broker_delivery")
    op.drop_table("broker_delivery")
    op.drop_index("ix_broker_group_topic", table_name="broker_group")
    op.drop_table("broker_group")
    op.drop_table("broker_message")
