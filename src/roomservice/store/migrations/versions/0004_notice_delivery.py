"""Notice delivery: one row per private notice the notice consumer sends.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

``notice_delivery_events`` is the notice consumer's record (group
``hyapp-notice-room-outbox``): one row per notice, keyed by the event it comes
from (``dedup_id``: a repair shares its original's row), written before the C2C
message is sent and updated after every attempt — ``status`` pending (not sent
yet), sent, or failed (IM refused it for good; a replay tries again),
``attempts``, ``last_error``, ``sent_at_ms`` and IM's ``msg_key``. ``payload``
is the message exactly as sent (a re-send must carry the same body for IM's
duplicate check).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from roomservice.store.migrations.ddl import MYSQL_TABLE as _MYSQL
from roomservice.store.migrations.ddl import ascii_id as _id
from roomservice.store.migrations.ddl import json_text as _json
from roomservice.store.migrations.ddl import ms as _ms

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "notice_delivery_events",
        sa.Column("event_id", _id(64), nullable=False),
        sa.Column("app_code", _id(32), nullable=False),
        sa.Column("room_id", _id(48), nullable=False),
        sa.Column("user_id", _id(64), nullable=False),
        sa.Column("im_account", _id(32), nullable=False),
        sa.Column("kind", _id(16), nullable=False),
        sa.Column("status", _id(8), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("payload", _json(), nullable=False),
        sa.Column("msg_key", sa.String(128), nullable=True),
        _ms("created_at_ms"),
        _ms("updated_at_ms"),
        _ms("sent_at_ms", nullable=True),
        sa.PrimaryKeyConstraint("event_id"),
        **_MYSQL,
    )
    # Operators: the notices still pending or failed, oldest first; a user's notices.
    op.create_index(
        "ix_notice_delivery_events_status_updated_at_ms", "notice_delivery_events", ["status", "updated_at_ms"]
    )
    op.create_index("ix_notice_delivery_events_app_code_user_id", "notice_delivery_events", ["app_code", "user_id"])


def downgrade() -> None:
    op.drop_index("ix_notice_delivery_events_app_code_user_id", table_name="notice_delivery_events")
    op.drop_index("ix_notice_delivery_events_status_updated_at_ms", table_name="notice_delivery_events")
    op.drop_table("notice_delivery_events")
