"""Which registry replica plans placements: the one holding the planner's lease.

Replicas share one database; each planning on its own would overwrite the others' plans, each drawn from
its own counts, so the workers' orders would flip between them. The lease is a PostgreSQL session-level
advisory lock on a connection of its own (in autocommit: no transaction stays open), or, for a SQLite file,
an flock on a file beside it. It goes with its holder: the process exits, or its connection breaks (the
next `held` notices), and the next replica to ask takes it. A replica without the lease skips its passes.
"""

from __future__ import annotations

import fcntl
import logging
from pathlib import Path
from typing import IO

from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from registry.db import sqlite_side_file

log = logging.getLogger(__name__)

PLANNER_LOCK_KEY = 0x7E55E8B  # the PostgreSQL advisory lock of the planner's lease (any constant but the migrations')


class PlannerLease:
    def __init__(self, database_url: str) -> None:
        url = make_url(database_url)
        self._postgres = url.get_backend_name() == "postgresql"
        # No pool: a closed connection is closed at the server, and a session lock never outlives it there.
        self._engine = create_engine(url, poolclass=NullPool) if self._postgres else None
        self._connection: Connection | None = None
        # A SQLite file: the lock file beside it; in memory (None): one process holds the database, and the lease.
        self._lock_path = sqlite_side_file(url, ".planner-lock")
        self._lock_file: IO[str] | None = None

    def held(self) -> bool:
        """Whether this replica holds the lease now, taking it if it is free (blocking: database I/O)."""
        if self._postgres:
            return self._hold_advisory_lock()
        return self._lock_path is None or self._hold_file_lock(self._lock_path)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        if self._engine is not None:
            self._engine.dispose()
        if self._lock_file is not None:
            self._lock_file.close()  # the flock goes with it
            self._lock_file = None

    def _hold_file_lock(self, path: Path) -> bool:
        if self._lock_file is None:
            lock_file = open(path, "a")
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock_file.close()
                return False
            self._lock_file = lock_file
            log.info("this registry replica plans placements now (it holds %s)", path)
        return True

    def _hold_advisory_lock(self) -> bool:
        assert self._engine is not None
        if self._connection is not None:
            try:
                self._connection.execute(text("SELECT 1"))
                return True
            except DBAPIError:  # the connection broke, and the session's lock with it
                log.warning("the planner's lease was lost with its database connection")
                self._connection.invalidate()
                self._connection.close()
                self._connection = None
        connection = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            taken = connection.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": PLANNER_LOCK_KEY}).scalar()
        except BaseException:
            connection.close()
            raise
        if not taken:
            connection.close()
            return False
        self._connection = connection
        log.info("this registry replica plans placements now (it holds the planner's advisory lock)")
        return True
