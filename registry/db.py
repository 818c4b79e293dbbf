"""Engine and session factory from a SQLAlchemy URL, and schema upgrades through Alembic.

SQLite (the embedded default) gets foreign keys on, WAL (readers never block
the one writer) and a busy timeout; any other URL (e.g.
``postgresql+psycopg://...``) is used as given.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
SQLITE_BUSY_TIMEOUT_S = 30.0


def _enable_sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def make_engine(database_url: str) -> Engine:
    """An engine for `database_url`; a SQLite file's parent directory is created."""
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    in_memory = url.database in (None, "", ":memory:")
    if not in_memory:
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url,
        # Flask threads and asyncio.to_thread workers share the pool.
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_S},
        # An in-memory database lives in one connection: every thread must share it.
        poolclass=StaticPool if in_memory else None,
    )
    event.listen(engine, "connect", _enable_sqlite_pragmas)
    return engine


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    # expire_on_commit=False: records are built from rows after commit without a reload.
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def upgrade_schema(database_url: str) -> None:
    """Run every Alembic migration up to head on `database_url` (idempotent)."""
    engine = make_engine(database_url)
    try:
        with engine.begin() as connection:
            config = alembic_config()
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
    finally:
        engine.dispose()
