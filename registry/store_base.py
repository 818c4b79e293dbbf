"""What every part of the registry's store shares: the database, one transaction per call, the clock.

The parts (catalog_store.py, worker_store.py, placement_store.py; registry/store.py composes them)
open a session and transaction in each method and return plain frozen records (registry/records.py),
so they are safe to call from Flask's threads and from asyncio through `asyncio.to_thread`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from registry.db import make_engine, make_session_factory
from services.common.errors import AlreadyExists


class StoreBase:
    def __init__(self, database_url: str, clock: Callable[[], float]) -> None:
        self._engine = make_engine(database_url)
        self._sessions = make_session_factory(self._engine)
        self._clock = clock  # wall clock (unix seconds): heartbeats are compared across processes

    @contextmanager
    def _transaction(self) -> Iterator[Session]:
        with self._sessions() as session, session.begin():
            yield session

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)


def insert_row(session: Session, row: Any, what: str) -> None:
    """Add and flush `row`; a unique-constraint race surfaces as AlreadyExists."""
    session.add(row)
    try:
        session.flush()
    except IntegrityError as exc:
        raise AlreadyExists(f"{what} already exists") from exc
