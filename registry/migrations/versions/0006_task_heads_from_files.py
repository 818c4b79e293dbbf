"""An adapter's task_head is derived from its files at registration (services/common/task_heads.py).

Before this revision it was free-form metadata given to the admin API, and head tensors were refused at
registration: no adapter registered before it carries a head, so every earlier value is cleared.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("UPDATE adapters SET task_head = NULL")


def downgrade() -> None:
    pass  # the cleared metadata is not restored; the column is unchanged
