"""The registry's catalog changes, handed from the thread that commits them to the WatchCatalog streams.

The store publishes after each commit that adds or removes an adapter or a base model (on a Flask
thread or an `asyncio.to_thread` worker); each subscriber is a gRPC stream on the registry's event
loop with a queue of its own, fed through `call_soon_threadsafe`. A gateway whose stream is away
(a restart, a network blip) misses changes: every subscription starts with an empty change, on
which the gateway refreshes its whole cache.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from registry.records import CatalogChange


class CatalogFeed:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribers: dict[asyncio.Queue[CatalogChange], asyncio.AbstractEventLoop] = {}

    def publish(self, change: CatalogChange) -> None:
        """Any thread: queue `change` for every subscriber (changes are rare admin operations)."""
        with self._lock:
            subscribers = list(self._subscribers.items())
        for queue, loop in subscribers:
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, change)

    @contextmanager
    def subscribe(self) -> Iterator[asyncio.Queue[CatalogChange]]:
        """On the event loop: a queue receiving every change published until the block exits."""
        queue: asyncio.Queue[CatalogChange] = asyncio.Queue()
        with self._lock:
            self._subscribers[queue] = asyncio.get_running_loop()
        try:
            yield queue
        finally:
            with self._lock:
                del self._subscribers[queue]
