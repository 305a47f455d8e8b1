"""Command timing: the ``room_command_timing`` figures stored with each logged command.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

``room_command_log.timing`` (JSON, nullable: rows written before this revision
have none) holds the stages the pipeline had measured when it wrote the row, in
the same transaction as the row itself: ``idempotency_ms``, ``lease_ms``,
``wallet_debit_ms``, ``activity_ms`` and the ``*_async_outbox`` flags. The
operators' console shows them in the room inspector, so they survive restarts.
The stages that run after the commit (``save_mutation_ms``, ``snapshot_ms``,
``projection_ms``, ``tencent_im_ms``, ``total_ms``) are in the
``room_command_timing`` log line only.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from roomservice.store.migrations.ddl import json_text as _json

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("room_command_log", sa.Column("timing", _json(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("room_command_log") as batch:
        batch.drop_column("timing")
