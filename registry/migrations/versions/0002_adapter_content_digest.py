"""An adapter's sha256 covers adapter_config.json too: it becomes content_digest(config, weights).

Rows written before this revision record the sha256 of adapter_model.safetensors alone, so a change
to the stored adapter_config.json (lora_alpha 32 -> 3200) went unnoticed. Each row now records
content_digest(sha256 of its stored config as it is now, its recorded weights sha256): only the
small config is read, and a weights file that changed before this upgrade still fails the worker's
check, because the recorded weights sha256 is what enters the digest. A config changed before this
upgrade is taken as it stands (nothing recorded it). Directories stay where they are, named by the
weights' sha256 (the store deletes by storage_path). A row whose config is missing or unreadable
keeps its old value, which no files match: the worker refuses it with "checksum mismatch" until an
admin registers the adapter again.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-26
"""

from __future__ import annotations

import logging
from pathlib import Path

import sqlalchemy as sa
from alembic import op

from services.common.adapter_layout import CONFIG_FILE, WEIGHTS_FILE, content_digest, file_sha256

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

log = logging.getLogger(__name__)

ADAPTERS = sa.table("adapters", sa.column("id", sa.Integer), sa.column("name", sa.String),
                    sa.column("sha256", sa.String), sa.column("storage_path", sa.String))


def _rewrite(new_sha256) -> None:  # type: ignore[no-untyped-def]
    """Set each row's sha256 to new_sha256(directory, old sha256), or leave it where that is None."""
    connection = op.get_bind()
    rows = connection.execute(sa.select(ADAPTERS.c.id, ADAPTERS.c.name, ADAPTERS.c.sha256,
                                        ADAPTERS.c.storage_path)).all()
    for row_id, name, old, storage_path in rows:
        try:
            new = new_sha256(Path(storage_path), old)
        except OSError as exc:
            log.warning("adapter %r: stored files unreadable (%s); its digest is left as it was", name, exc)
            continue
        if new is not None:
            connection.execute(sa.update(ADAPTERS).where(ADAPTERS.c.id == row_id).values(sha256=new))


def upgrade() -> None:
    _rewrite(lambda directory, weights_sha256: content_digest(file_sha256(directory / CONFIG_FILE), weights_sha256))


def downgrade() -> None:
    def weights_only(directory: Path, digest: str) -> str | None:
        weights = file_sha256(directory / WEIGHTS_FILE)
        # Only files that still match the record go back: a tampered adapter keeps failing its check.
        return weights if content_digest(file_sha256(directory / CONFIG_FILE), weights) == digest else None
    _rewrite(weights_only)
