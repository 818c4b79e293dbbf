"""The placement planner's decisions: which adapters each worker holds on its GPU or in host memory.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "planned_placements",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("adapter", sa.String(128), nullable=False),
        sa.Column("worker_address", sa.String(256), nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("rate", sa.Float(), nullable=False),
        sa.Column("planned_ms", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["adapter"], ["adapters.name"], ondelete="CASCADE",
                                name="fk_planned_placements_adapter_adapters"),
        sa.PrimaryKeyConstraint("id", name="pk_planned_placements"),
        sa.UniqueConstraint("adapter", "worker_address", name="uq_planned_placements_adapter_worker"),
    )


def downgrade() -> None:
    op.drop_table("planned_placements")
