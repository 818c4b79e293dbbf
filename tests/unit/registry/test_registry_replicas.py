"""Registry replicas on one database and one adapter store: a catalog change made through one reaches the
watchers of every other (PostgreSQL's NOTIFY, registry/catalog_relay.py), and the adapter store's writes
take turns across processes (registry/store_lock.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from pathlib import Path

import pytest

from registry.catalog_relay import CatalogRelay
from registry.records import CatalogChange
from registry.store import RegistryStore
from registry.store_lock import StoreLock

from .conftest import BASE_MODEL, FakeClock


@pytest.fixture
def replicas(postgres_server, tmp_path: Path, imports: Path, clock: FakeClock):
    url = postgres_server.new_database()
    stores = [RegistryStore(url, tmp_path / "store", [imports], worker_timeout_s=10.0, clock=clock) for _ in range(2)]
    stores[0].register_base_model(BASE_MODEL, str(imports / "base"))
    yield url, stores
    for store in stores:
        store.close()


async def _next(changes: asyncio.Queue, timeout_s: float = 5.0) -> CatalogChange:
    return await asyncio.wait_for(changes.get(), timeout_s)


@pytest.mark.postgres
def test_a_change_through_one_replica_reaches_the_other_replicas_watchers_once(replicas, imports: Path,
                                                                                postgres_server) -> None:
    url, (first, second) = replicas
    relay = CatalogRelay(url, second.changes, second.replica)
    relay.start()
    try:
        assert relay.listening.wait(10)

        async def watch() -> None:
            with second.changes.subscribe() as changes, first.changes.subscribe() as own:
                await asyncio.to_thread(first.register_adapter, "a1", BASE_MODEL, str(imports / "attn-qv"))
                assert await _next(changes) == CatalogChange()
                assert await _next(own) == CatalogChange()  # the first replica's watchers: from the store itself
                await asyncio.to_thread(first.delete_adapter, "a1")
                assert await _next(changes) == CatalogChange(removed_adapters=("a1",))
                await asyncio.to_thread(second.register_adapter, "a2", BASE_MODEL, str(imports / "attn-qv"))
                assert await _next(changes) == CatalogChange()  # its own change, from the store ...
                with pytest.raises(TimeoutError):
                    await _next(changes, 1.0)  # ... and not a second time through the relay

                # The database drops the relay's connection: once back it asks every watcher to refresh.
                await asyncio.to_thread(postgres_server.terminate_connections)
                assert await _next(changes, 10) == CatalogChange()
                await asyncio.to_thread(first.delete_adapter, "a2")
                assert await _next(changes, 10) == CatalogChange(removed_adapters=("a2",))
        asyncio.run(watch())
    finally:
        relay.close()
    assert second.get_base_model(BASE_MODEL).name == BASE_MODEL  # one database: the other's rows


def _hold(root: Path, held: multiprocessing.Event, release: multiprocessing.Event) -> None:
    with StoreLock(root):
        held.set()
        release.wait(30)


def test_the_store_lock_is_held_across_processes(tmp_path: Path) -> None:
    held, release = multiprocessing.Event(), multiprocessing.Event()
    other = multiprocessing.get_context("fork").Process(target=_hold, args=(tmp_path, held, release))
    other.start()
    try:
        assert held.wait(10)
        lock = StoreLock(tmp_path)
        waited: list[float] = []

        def release_later() -> None:
            time.sleep(0.5)
            release.set()
        threading.Thread(target=release_later).start()
        started = time.monotonic()
        with lock:
            waited.append(time.monotonic() - started)
        assert waited[0] >= 0.4, "the lock was taken while another process held it"
        lock.close()
    finally:
        release.set()
        other.join(10)
