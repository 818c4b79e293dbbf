"""Adapters record the tasks they serve, with the accuracy `tessera fuse` measured for each (docs/fuse.md).

Adapters registered before this revision name no task (NULL): requests reach them by name only.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("adapters", sa.Column("tasks", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:  # SQLite drops columns by copying the table
        batch.drop_column("tasks")
