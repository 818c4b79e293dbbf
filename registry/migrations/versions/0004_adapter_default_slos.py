"""Adapters carry default objectives (TPOT, TTFT) for the requests that name none.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Adapters registered before this revision: no defaults of their own (NULL), the gateway's apply.
    op.add_column("adapters", sa.Column("tpot_slo_ms", sa.Float(), nullable=True))
    op.add_column("adapters", sa.Column("ttft_slo_ms", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:  # SQLite drops columns by copying the table
        batch.drop_column("ttft_slo_ms")
        batch.drop_column("tpot_slo_ms")
