"""Engine and session factory from a SQLAlchemy URL, and schema upgrades through Alembic.

SQLite (the embedded default) gets foreign keys on, WAL (readers never block
the one writer) and a busy timeout; any other URL (e.g.
``postgresql+psycopg://...``) is used as given.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import URL, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
SQLITE_BUSY_TIMEOUT_S = 30.0
MIGRATION_LOCK_KEY = 0x7E55E8A  # the PostgreSQL advisory lock the registry's migrations hold (any constant)


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


def sqlite_side_file(url: URL, suffix: str) -> Path | None:
    """The file beside a SQLite database file named as it plus `suffix` (for locks its processes share);
    None for another backend or an in-memory database (one process)."""
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database).expanduser().with_name(Path(url.database).name + suffix)


@contextmanager
def _sqlite_file_lock(url: URL) -> Iterator[None]:
    """Held around a SQLite file's migrations: SQLite takes its write lock only at the first write, after
    each process has read the schema's version, so two would both migrate."""
    lock_path = sqlite_side_file(url, ".migrate-lock")
    if lock_path is None:
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def upgrade_schema(database_url: str) -> None:
    """Run every Alembic migration up to head on `database_url` (idempotent). Registry replicas starting
    together on one database take turns: the first migrates, the others find the schema at head."""
    url = make_url(database_url)
    engine = make_engine(database_url)
    try:
        with _sqlite_file_lock(url), engine.begin() as connection:
            if url.get_backend_name() == "postgresql":  # held until this transaction commits
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            config = alembic_config()
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
    finally:
        engine.dispose()
