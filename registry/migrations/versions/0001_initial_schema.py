"""Initial schema: base models, adapters, workers, placements.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "base_models",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("architecture", sa.String(128), nullable=False),
        sa.Column("path", sa.String(4096), nullable=False),
        sa.Column("max_context", sa.Integer(), nullable=False),
        sa.Column("vocab_size", sa.Integer(), nullable=False),
        sa.Column("hidden_size", sa.Integer(), nullable=False),
        sa.Column("num_layers", sa.Integer(), nullable=False),
        sa.Column("module_shapes", sa.JSON(), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_base_models"),
        sa.UniqueConstraint("name", name="uq_base_models_name"),
    )
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("base_model", sa.String(128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("target_modules", sa.JSON(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("storage_path", sa.String(4096), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("task_head", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(["base_model"], ["base_models.name"], ondelete="RESTRICT",
                                name="fk_adapters_base_model_base_models"),
        sa.PrimaryKeyConstraint("id", name="pk_adapters"),
        sa.UniqueConstraint("name", name="uq_adapters_name"),
    )
    op.create_index("ix_adapters_base_model", "adapters", ["base_model"])
    op.create_index("ix_adapters_sha256", "adapters", ["sha256"])
    op.create_table(
        "workers",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("address", sa.String(256), nullable=False),
        sa.Column("device", sa.String(64), nullable=False),
        sa.Column("base_model", sa.String(128), nullable=False),
        sa.Column("capacity", sa.Integer(), nullable=False),
        sa.Column("last_heartbeat_ms", sa.BigInteger(), nullable=False),
        sa.Column("stats", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_workers"),
        sa.UniqueConstraint("address", name="uq_workers_address"),
    )
    op.create_index("ix_workers_base_model", "workers", ["base_model"])
    op.create_table(
        "placements",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("adapter", sa.String(128), nullable=False),
        sa.Column("worker_id", sa.String(36), nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("updated_ms", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["adapter"], ["adapters.name"], ondelete="CASCADE",
                                name="fk_placements_adapter_adapters"),
        sa.ForeignKeyConstraint(["worker_id"], ["workers.id"], ondelete="CASCADE",
                                name="fk_placements_worker_id_workers"),
        sa.PrimaryKeyConstraint("id", name="pk_placements"),
        sa.UniqueConstraint("adapter", "worker_id", name="uq_placements_adapter_worker"),
    )
    op.create_index("ix_placements_worker_id", "placements", ["worker_id"])


def downgrade() -> None:
    op.drop_table("placements")
    op.drop_table("workers")
    op.drop_table("adapters")
    op.drop_table("base_models")
