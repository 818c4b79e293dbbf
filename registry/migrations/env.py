"""Alembic environment: runs migrations on the connection that `registry.db.upgrade_schema` passes in.

Run only programmatically (there is no alembic.ini): the caller owns the
engine, so SQLite pragmas and pooling match the running registry.
"""

from __future__ import annotations

from alembic import context

from registry.models import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through registry.db.upgrade_schema(url)")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    # SQLite cannot ALTER most things: batch mode rebuilds tables for later revisions.
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
