"""RegistryStore: the registry's one domain API over the database and the adapter store.

It composes the store's parts, one noun each: the catalog of base models and adapters
(catalog_store.py), the workers (worker_store.py), and where adapters are placed (placement_store.py),
all over one database (store_base.py). Every method opens its own session and transaction and returns
plain frozen records (registry/records.py), so it is safe to call from Flask's threads and from
asyncio through `asyncio.to_thread`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from registry.catalog_store import CatalogStore
from registry.db import upgrade_schema
from registry.placement_store import PlacementStore
from registry.store_base import StoreBase
from registry.worker_store import WorkerStore
from services.common.config import TesseraConfig


class RegistryStore(CatalogStore, PlacementStore, WorkerStore):
    def __init__(self, database_url: str, adapter_store: Path, import_roots: list[Path],
                 worker_timeout_s: float, clock: Callable[[], float] = time.time,
                 deleted_files_grace_s: float = 600.0, worker_expiry_s: float = 3600.0) -> None:
        """`deleted_files_grace_s`: a deleted adapter's files stay this long for the requests workers
        took before it was deleted (`sweep_deleted_files` removes them after). `worker_expiry_s`: a worker
        silent this long is forgotten (`expire_workers`)."""
        self._init_workers(worker_timeout_s, worker_expiry_s)  # first: it checks its settings before anything opens
        StoreBase.__init__(self, database_url, clock)
        self._init_catalog(adapter_store, import_roots, deleted_files_grace_s)

    @classmethod
    def from_config(cls, config: TesseraConfig) -> "RegistryStore":
        """The store for `config`, with the database schema migrated to head first."""
        upgrade_schema(config.database_url)
        return cls(config.database_url, config.adapter_store_path, config.import_root_paths,
                   config.registry.worker_timeout_s, deleted_files_grace_s=config.registry.deleted_files_grace_s,
                   worker_expiry_s=config.registry.worker_expiry_s)

    def close(self) -> None:
        self._engine.dispose()
        self._blob_lock.close()
