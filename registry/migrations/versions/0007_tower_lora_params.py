"""Adapters record their LoRA parameters on the vision tower and projector (services/common/tower_lora.py).

Before this revision an adapter with tensors there was refused at registration: every earlier row has none, 0.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("adapters", sa.Column("tower_lora_params", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:  # SQLite drops columns by copying the table
        batch.drop_column("tower_lora_params")
