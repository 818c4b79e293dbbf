"""The registry's workers: registration, heartbeats, health and expiry."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from registry.catalog_store import check_name
from registry.models import PlacementRow, WorkerRow
from registry.records import WorkerRecord
from registry.store_base import StoreBase, insert_row
from services.common.errors import InvalidArgument, NotFound


class WorkerStore(StoreBase):
    def _init_workers(self, worker_timeout_s: float, worker_expiry_s: float) -> None:
        """Called once by RegistryStore.__init__. A worker is healthy while its last heartbeat is at most
        `worker_timeout_s` old, and forgotten once silent past `worker_expiry_s`."""
        assert worker_expiry_s >= worker_timeout_s, (worker_expiry_s, worker_timeout_s)
        self._worker_timeout_ms = int(worker_timeout_s * 1000)
        self._worker_expiry_ms = int(worker_expiry_s * 1000)

    def register_worker(self, address: str, device: str, base_model: str, capacity: int) -> WorkerRecord:
        """A fresh worker id for `address`; an earlier registration of that address is replaced."""
        if not address or len(address) > 256:
            raise InvalidArgument("worker address must be 1-256 characters (host:port)")
        if not device or len(device) > 64:
            raise InvalidArgument("worker device must be 1-64 characters")
        check_name(base_model, "base model")
        if capacity <= 0:
            raise InvalidArgument(f"worker capacity must be positive, got {capacity}")
        row = WorkerRow(id=str(uuid.uuid4()), address=address, device=device, base_model=base_model,
                        capacity=capacity, last_heartbeat_ms=self._now_ms(), stats={})
        with self._transaction() as s:
            # A restarted worker comes back at the same address: its old placements are stale.
            old_ids = select(WorkerRow.id).where(WorkerRow.address == address).scalar_subquery()
            s.execute(delete(PlacementRow).where(PlacementRow.worker_id.in_(old_ids)))
            s.execute(delete(WorkerRow).where(WorkerRow.address == address))
            insert_row(s, row, f"worker at {address!r}")
            return self._worker_record(row)

    def heartbeat(self, worker_id: str, stats: dict[str, Any]) -> bool:
        """Record a heartbeat; False if the worker is unknown (it must register again)."""
        with self._transaction() as s:
            row = s.get(WorkerRow, worker_id)
            if row is None:
                return False
            row.last_heartbeat_ms = self._now_ms()
            row.stats = stats
            return True

    def expire_workers(self) -> list[WorkerRecord]:
        """Forget the workers silent for `worker_expiry_s` (gone: killed, scaled in, moved), with the
        placements they reported; the records removed. One that comes back registers again."""
        horizon = self._now_ms() - self._worker_expiry_ms
        with self._transaction() as s:
            rows = list(s.scalars(select(WorkerRow).where(WorkerRow.last_heartbeat_ms < horizon)))
            ids = [row.id for row in rows]
            if ids:
                s.execute(delete(PlacementRow).where(PlacementRow.worker_id.in_(ids)))
                s.execute(delete(WorkerRow).where(WorkerRow.id.in_(ids)))
            return [self._worker_record(row) for row in rows]

    def list_workers(self, base_model: str | None = None, healthy_only: bool = False) -> list[WorkerRecord]:
        query = select(WorkerRow).order_by(WorkerRow.address)
        if base_model:
            query = query.where(WorkerRow.base_model == base_model)
        if healthy_only:
            query = query.where(WorkerRow.last_heartbeat_ms >= self._now_ms() - self._worker_timeout_ms)
        with self._transaction() as s:
            return [self._worker_record(r) for r in s.scalars(query)]

    def _worker_record(self, row: WorkerRow) -> WorkerRecord:
        healthy = self._now_ms() - row.last_heartbeat_ms <= self._worker_timeout_ms
        return WorkerRecord(
            worker_id=row.id, address=row.address, device=row.device, base_model=row.base_model,
            capacity=row.capacity, last_heartbeat_unix_ms=row.last_heartbeat_ms, healthy=healthy,
            stats=dict(row.stats))


def worker_addresses(session: Session, worker_ids: Sequence[str], base_model: str) -> dict[str, str]:
    """Worker id -> address for the registered workers `worker_ids`, each of which must serve `base_model`."""
    rows = {r.id: r for r in session.scalars(select(WorkerRow).where(WorkerRow.id.in_(list(worker_ids))))}
    for worker_id in worker_ids:
        row = rows.get(worker_id)
        if row is None:
            raise NotFound(f"worker {worker_id!r} is not registered")
        if row.base_model != base_model:
            raise InvalidArgument(f"worker {worker_id!r} serves base model {row.base_model!r}, not the adapter's "
                                  f"{base_model!r}", param="workers")
    return {w: rows[w].address for w in worker_ids}
