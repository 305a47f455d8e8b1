"""Outbox trace context: the W3C traceparent of the command that wrote each row.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

``room_outbox.trace_context`` is written in the same insert as the row when
tracing is on (NULL otherwise, and for every row written before). The outbox
worker's delivery span continues it, so one trace runs from the request to the
broker and its consumers however long the row waited, across worker restarts.

It revises 0005 (the console's room_command_log timing column), which landed after it was written.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from roomservice.store.migrations.ddl import ascii_id as _id

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("room_outbox", sa.Column("trace_context", _id(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("room_outbox") as batch:
        batch.drop_column("trace_context")
