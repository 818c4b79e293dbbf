"""Catalog changes between registry replicas on one PostgreSQL database.

A gateway follows the catalog through one replica (WatchCatalog), but an operator's change may go through
another. Each replica announces its changes with NOTIFY on CHANNEL after they commit; `CatalogRelay`
LISTENs on a connection of its own, in a thread, and publishes the other replicas' changes into this
replica's feed (registry/catalog_feed.py), so a deleted adapter leaves every gateway at once, whichever
replica deleted it. While the relay is away (the database restarting) nothing is relayed: when it is
back it publishes an empty change, on which every gateway refreshes its whole cache. SQLite has no other
replica to tell.
"""

from __future__ import annotations

import json
import logging
import threading

from sqlalchemy import Connection, text
from sqlalchemy.engine import make_url

from registry.catalog_feed import CatalogFeed
from registry.records import CatalogChange

log = logging.getLogger(__name__)

CHANNEL = "tessera_catalog"
RETRY_S = 1.0
POLL_S = 0.5  # how soon the relay notices it is asked to stop


def announce(connection: Connection, change: CatalogChange, replica: str) -> None:
    """NOTIFY the other replicas of `change` (sent when `connection`'s transaction commits)."""
    payload = json.dumps({"replica": replica, "removed_adapters": list(change.removed_adapters)})
    connection.execute(text("SELECT pg_notify(:channel, :payload)"), {"channel": CHANNEL, "payload": payload})


def libpq_conninfo(database_url: str) -> str:
    """The SQLAlchemy URL (postgresql+psycopg://...) as the libpq URI psycopg connects with."""
    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)


class CatalogRelay:
    def __init__(self, database_url: str, feed: CatalogFeed, replica: str) -> None:
        self._conninfo = libpq_conninfo(database_url)
        self._feed, self._replica = feed, replica
        self._stop = threading.Event()
        self.listening = threading.Event()  # set while LISTENing
        self._thread = threading.Thread(target=self._run, name="catalog-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psycopg

        away = False
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._conninfo, autocommit=True) as connection:
                    connection.execute(f"LISTEN {CHANNEL}")
                    self.listening.set()
                    if away:  # changes made meanwhile were not relayed: every watcher refreshes
                        log.info("catalog relay listening again")
                        self._feed.publish(CatalogChange())
                    while not self._stop.is_set():
                        for notification in connection.notifies(timeout=POLL_S):
                            self._relay(notification.payload)
            except psycopg.Error as exc:
                self.listening.clear()
                away = True
                log.warning("catalog relay lost the database (%s); retrying in %.0f s", type(exc).__name__, RETRY_S)
                self._stop.wait(RETRY_S)

    def _relay(self, payload: str) -> None:
        try:
            message = json.loads(payload)
            replica, removed = message["replica"], tuple(str(name) for name in message["removed_adapters"])
        except (ValueError, KeyError, TypeError):
            log.warning("ignored a malformed catalog notification")
            return
        if replica != self._replica:
            self._feed.publish(CatalogChange(removed_adapters=removed))
