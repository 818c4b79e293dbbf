"""Placements carry whether the adapter is loading and whether an operator pinned it; operators'
placement orders (pin or preload an adapter on a worker, or on every worker of its base model).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Rows reported before this revision: not loading, not pinned (pins did not exist).
    op.add_column("placements", sa.Column("loading", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.add_column("placements", sa.Column("pinned", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.create_table(
        "placement_orders",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("adapter", sa.String(128), nullable=False),
        sa.Column("worker_address", sa.String(256), nullable=False),
        sa.Column("pin", sa.Boolean(), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["adapter"], ["adapters.name"], ondelete="CASCADE",
                                name="fk_placement_orders_adapter_adapters"),
        sa.PrimaryKeyConstraint("id", name="pk_placement_orders"),
        sa.UniqueConstraint("adapter", "worker_address", name="uq_placement_orders_adapter_worker"),
    )


def downgrade() -> None:
    op.drop_table("placement_orders")
    with op.batch_alter_table("placements") as batch:  # SQLite drops columns by copying the table
        batch.drop_column("pinned")
        batch.drop_column("loading")
