"""Direct delivery: IM sent-event record, and the reference activity service's tables.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

``im_sent_event`` is the IM publisher's own record of event_ids it sent, so a
re-send after Tencent's 5-minute duplicate window is still absorbed. The
``activity_*`` tables belong to the reference activity service: its processed
event ids are written in the same transaction as their effect.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from roomservice.store.migrations.ddl import MYSQL_TABLE as _MYSQL
from roomservice.store.migrations.ddl import ascii_id as _id
from roomservice.store.migrations.ddl import ms as _ms

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "im_sent_event",
        sa.Column("event_id", _id(64), nullable=False),
        sa.Column("group_id", _id(128), nullable=False),
        sa.Column("operation", _id(32), nullable=False),
        _ms("sent_at_ms"),
        sa.PrimaryKeyConstraint("event_id", "operation"),
        **_MYSQL,
    )
    op.create_index("ix_im_sent_event_sent_at_ms", "im_sent_event", ["sent_at_ms"])
    op.create_index("ix_im_sent_event_group_id_operation", "im_sent_event", ["group_id", "operation"])

    op.create_table(
        "activity_processed_event",
        sa.Column("event_id", _id(64), nullable=False),
        sa.Column("event_type", _id(64), nullable=False),
        _ms("processed_at_ms"),
        sa.PrimaryKeyConstraint("event_id"),
        **_MYSQL,
    )
    op.create_index("ix_activity_processed_event_processed_at_ms", "activity_processed_event", ["processed_at_ms"])

    op.create_table(
        "activity_gift_board",
        sa.Column("app_code", _id(32), nullable=False),
        sa.Column("room_id", _id(48), nullable=False),
        sa.Column("day", sa.Integer(), nullable=False),
        sa.Column("board", _id(16), nullable=False),
        sa.Column("user_id", _id(64), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        _ms("updated_at_ms"),
        sa.PrimaryKeyConstraint("app_code", "room_id", "day", "board", "user_id"),
        **_MYSQL,
    )
    op.create_index(
        "ix_activity_gift_board_app_code_room_id_day_board_value",
        "activity_gift_board",
        ["app_code", "room_id", "day", "board", "value"],
    )

    op.create_table(
        "activity_treasure_reward",
        sa.Column("app_code", _id(32), nullable=False),
        sa.Column("room_id", _id(48), nullable=False),
        sa.Column("box_id", _id(64), nullable=False),
        sa.Column("user_id", _id(64), nullable=False),
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("event_id", _id(64), nullable=False),
        _ms("created_at_ms"),
        sa.PrimaryKeyConstraint("app_code", "room_id", "box_id", "user_id"),
        **_MYSQL,
    )


def downgrade() -> None:
    op.drop_table("activity_treasure_reward")
    op.drop_index("ix_activity_gift_board_app_code_room_id_day_board_value", table_name="activity_gift_board")
    op.drop_table("activity_gift_board")
    op.drop_index("ix_activity_processed_event_processed_at_ms", table_name="activity_processed_event")
    op.drop_table("activity_processed_event")
    op.drop_index("ix_im_sent_event_group_id_operation", table_name="im_sent_event")
    op.drop_index("ix_im_sent_event_sent_at_ms", table_name="im_sent_event")
    op.drop_table("im_sent_event")
