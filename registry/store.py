"""RegistryStore: the registry's one domain API over the database and the adapter store.

Every method opens its own session and transaction and returns plain frozen
records (registry/records.py), so it is safe to call from Flask's threads and
from asyncio through `asyncio.to_thread`.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from registry.adapter_blobs import AdapterBlobStore
from registry.adapter_files import locate_adapter_files, validate_adapter_dir
from registry.base_model_files import read_base_model_spec
from registry.catalog_feed import CatalogFeed
from registry.catalog_relay import announce
from registry.db import make_engine, make_session_factory, upgrade_schema
from registry.models import AdapterRow, BaseModelRow, PlacementOrderRow, PlacementRow, PlannedPlacementRow, WorkerRow
from registry.records import (AdapterRecord, AdapterVersion, BaseModelRecord, CatalogChange, ModuleShape,
                              PlacementInputs, PlacementOrderRecord, PlacementRecord, PlannedPlacementRecord,
                              ReportedPlacement, Tier, WorkerOrders, WorkerRecord)
from registry.store_lock import StoreLock
from registry.trusted_paths import real_roots, resolve_inside_roots
from services.common.config import TesseraConfig
from services.common.errors import AlreadyExists, InvalidArgument, NotFound
from services.common.slo import check_slo_ms

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
TIER_ORDER = list(Tier)  # fastest first


def check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidArgument(
            f"{what} name {name!r} is invalid: use 1-128 characters from letters, digits and . _ : -, "
            "starting with a letter or digit")
    return name


def _base_model_record(row: BaseModelRow) -> BaseModelRecord:
    return BaseModelRecord(
        name=row.name, architecture=row.architecture, path=row.path, max_context=row.max_context,
        vocab_size=row.vocab_size, hidden_size=row.hidden_size, num_layers=row.num_layers,
        module_shapes={m: ModuleShape(**shape) for m, shape in row.module_shapes.items()},
        created_unix_ms=row.created_ms)


def _adapter_record(row: AdapterRow) -> AdapterRecord:
    return AdapterRecord(
        name=row.name, base_model=row.base_model, rank=row.rank, alpha=row.alpha,
        target_modules=tuple(row.target_modules), size_bytes=row.size_bytes, sha256=row.sha256,
        storage_path=row.storage_path, created_unix_ms=row.created_ms, task_head=row.task_head,
        tpot_slo_ms=row.tpot_slo_ms, ttft_slo_ms=row.ttft_slo_ms)


def _checked_slos(tpot_slo_ms: float | None, ttft_slo_ms: float | None) -> tuple[float | None, float | None]:
    return (None if tpot_slo_ms is None else check_slo_ms(tpot_slo_ms, "tpot_slo_ms"),
            None if ttft_slo_ms is None else check_slo_ms(ttft_slo_ms, "ttft_slo_ms"))


def _placement_record(row: PlacementRow) -> PlacementRecord:
    return PlacementRecord(adapter=row.adapter, worker_id=row.worker_id, tier=Tier(row.tier),
                           updated_unix_ms=row.updated_ms, loading=row.loading, pinned=row.pinned)


def _order_record(row: PlacementOrderRow) -> PlacementOrderRecord:
    return PlacementOrderRecord(adapter=row.adapter, worker_address=row.worker_address or None, pin=row.pin,
                                created_unix_ms=row.created_ms)


class RegistryStore:
    def __init__(self, database_url: str, adapter_store: Path, import_roots: list[Path],
                 worker_timeout_s: float, clock: Callable[[], float] = time.time,
                 deleted_files_grace_s: float = 600.0, worker_expiry_s: float = 3600.0) -> None:
        """`deleted_files_grace_s`: a deleted adapter's files stay this long for the requests workers
        took before it was deleted (`sweep_deleted_files` removes them after). `worker_expiry_s`: a worker
        silent this long is forgotten (`expire_workers`)."""
        assert worker_expiry_s >= worker_timeout_s, (worker_expiry_s, worker_timeout_s)
        self._engine = make_engine(database_url)
        self._sessions = make_session_factory(self._engine)
        self._blobs = AdapterBlobStore(adapter_store)
        self._roots = real_roots(import_roots)
        self._worker_timeout_ms = int(worker_timeout_s * 1000)
        self._worker_expiry_ms = int(worker_expiry_s * 1000)
        self._clock = clock  # wall clock (unix seconds): heartbeats are compared across processes
        self._deleted_files_grace_s = deleted_files_grace_s
        # Serialises each write with the check before it that another row allows it: blob commits and
        # removals with the rows that reference them (dedup vs delete), and a new name against both the
        # adapters and the base models (requests name either in one `model` field); across replicas too.
        self._blob_lock = StoreLock(adapter_store)
        self.changes = CatalogFeed()  # published after each commit that changes the catalog
        self.replica = uuid.uuid4().hex  # this store among the registry replicas on one database

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

    def _announce(self, change: CatalogChange) -> None:
        """Tell this registry's catalog watchers, and on PostgreSQL the other replicas' (catalog_relay.py)."""
        self.changes.publish(change)
        if self._engine.dialect.name == "postgresql":
            with self._engine.begin() as connection:
                announce(connection, change, self.replica)

    @contextmanager
    def _transaction(self) -> Iterator[Session]:
        with self._sessions() as session, session.begin():
            yield session

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    # Base models

    def register_base_model(self, name: str, path: str) -> BaseModelRecord:
        check_name(name, "base model")
        directory = resolve_inside_roots(path, self._roots, "base model directory")
        spec = read_base_model_spec(directory)
        row = BaseModelRow(
            name=name, architecture=spec.architecture, path=str(directory),
            max_context=spec.max_context, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            num_layers=spec.num_layers,
            module_shapes={m: {"in_features": s.in_features, "out_features": s.out_features}
                           for m, s in spec.module_shapes.items()},
            created_ms=self._now_ms())
        with self._blob_lock, self._transaction() as s:
            if s.scalar(select(BaseModelRow.id).where(BaseModelRow.name == name)) is not None:
                raise AlreadyExists(f"base model {name!r} already exists")
            if s.scalar(select(AdapterRow.id).where(AdapterRow.name == name)) is not None:
                raise AlreadyExists(f"{name!r} is already an adapter's name; a base model may not take it "
                                    "(requests name a base model or an adapter in the same `model` field)")
            _insert(s, row, f"base model {name!r}")
            record = _base_model_record(row)
        self._announce(CatalogChange())
        return record

    def get_base_model(self, name: str) -> BaseModelRecord:
        with self._transaction() as s:
            return _base_model_record(_get_base_model_row(s, name))

    def list_base_models(self) -> list[BaseModelRecord]:
        with self._transaction() as s:
            return [_base_model_record(r) for r in s.scalars(select(BaseModelRow).order_by(BaseModelRow.name))]

    # Adapters

    def register_adapter(self, name: str, base_model: str, source_dir: str,
                         task_head: dict[str, Any] | None = None, tpot_slo_ms: float | None = None,
                         ttft_slo_ms: float | None = None) -> AdapterRecord:
        """Validate the PEFT adapter in `source_dir` against `base_model` and import it by content.
        `tpot_slo_ms`, `ttft_slo_ms`: its default objectives for requests that name none.

        The files are copied into a staging directory first and validated there,
        so the stored bytes are exactly the validated ones.
        """
        check_name(name, "adapter")
        if task_head is not None and not isinstance(task_head, dict):
            raise InvalidArgument("task_head must be a JSON object")
        tpot_slo_ms, ttft_slo_ms = _checked_slos(tpot_slo_ms, ttft_slo_ms)
        with self._transaction() as s:
            base = _base_model_record(_get_base_model_row(s, base_model))
            _check_adapter_name_free(s, name)
        staged = self._blobs.stage(locate_adapter_files(source_dir, self._roots))
        with self._blob_lock:
            try:
                spec = validate_adapter_dir(staged.directory, base.architecture, base.num_layers, base.module_shapes)
                with self._transaction() as s:
                    _check_adapter_name_free(s, name)
                    storage = self._blobs.commit(staged)
                    row = AdapterRow(
                        name=name, base_model=base.name, rank=spec.rank, alpha=spec.alpha,
                        target_modules=list(spec.target_modules), size_bytes=staged.size_bytes,
                        sha256=staged.sha256, storage_path=str(storage), created_ms=self._now_ms(),
                        task_head=task_head, tpot_slo_ms=tpot_slo_ms, ttft_slo_ms=ttft_slo_ms)
                    _insert(s, row, f"adapter {name!r}")
                    record = _adapter_record(row)
            except BaseException:
                self._blobs.discard(staged)
                self._retire_blob_if_unreferenced(str(self._blobs.path_for(staged.sha256)))
                raise
        self._announce(CatalogChange())
        return record

    def get_adapter(self, name: str) -> AdapterRecord:
        with self._transaction() as s:
            return _adapter_record(_get_adapter_row(s, name))

    def list_adapters(self, base_model: str | None = None) -> list[AdapterRecord]:
        query = select(AdapterRow).order_by(AdapterRow.name)
        if base_model:
            query = query.where(AdapterRow.base_model == base_model)
        with self._transaction() as s:
            return [_adapter_record(r) for r in s.scalars(query)]

    def set_adapter_slos(self, name: str, tpot_slo_ms: float | None, ttft_slo_ms: float | None) -> AdapterRecord:
        """Replace the adapter's default objectives (None: the gateway's); the gateways take them at once."""
        tpot_slo_ms, ttft_slo_ms = _checked_slos(tpot_slo_ms, ttft_slo_ms)
        with self._transaction() as s:
            row = _get_adapter_row(s, name)
            row.tpot_slo_ms, row.ttft_slo_ms = tpot_slo_ms, ttft_slo_ms
            record = _adapter_record(row)
        self._announce(CatalogChange())
        return record

    def delete_adapter(self, name: str) -> None:
        """Remove the adapter, its placements and placement orders; its stored files go once no adapter
        shares them, after the grace the worker's queued requests may need them for. The gateways stop
        resolving it at once (`changes`); workers drop it from their tiers once its in-flight requests
        end (`worker_orders` tells them to)."""
        with self._blob_lock:
            with self._transaction() as s:
                row = _get_adapter_row(s, name)
                storage_path = row.storage_path
                s.execute(delete(PlacementRow).where(PlacementRow.adapter == name))
                s.execute(delete(PlacementOrderRow).where(PlacementOrderRow.adapter == name))
                s.delete(row)
            self._retire_blob_if_unreferenced(storage_path)
        self._announce(CatalogChange(removed_adapters=(name,)))

    def sweep_deleted_files(self) -> list[Path]:
        """Remove the stored files of deleted adapters whose grace has passed (unless registered again)."""
        with self._blob_lock:
            return self._blobs.sweep(self._clock(), self._deleted_files_grace_s, self._blob_referenced)

    def _blob_referenced(self, directory: Path) -> bool:
        with self._transaction() as s:
            return bool(s.scalar(select(func.count()).select_from(AdapterRow)
                                 .where(AdapterRow.storage_path == str(directory))))

    def _retire_blob_if_unreferenced(self, storage_path: str) -> None:
        # By path, not digest: a row from before migration 0002 keeps its directory under the weights'
        # sha256 while its digest covers both files, so a new import of the same files lies elsewhere.
        if not self._blob_referenced(Path(storage_path)):
            self._blobs.retire(Path(storage_path), self._clock())

    # Workers

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
            _insert(s, row, f"worker at {address!r}")
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

    # Placements

    def replace_placements(self, worker_id: str, placements: Sequence[ReportedPlacement]) -> list[PlacementRecord]:
        """Replace the worker's whole placement set.

        An adapter listed twice keeps its fastest tier (GPU-resident and also
        cached in host memory is a normal state). Adapters the registry no
        longer knows (deleted while a worker still holds them) are skipped.
        """
        fastest: dict[str, ReportedPlacement] = {}
        for placement in placements:
            kept = fastest.get(placement.adapter)
            if kept is None or TIER_ORDER.index(Tier(placement.tier)) < TIER_ORDER.index(Tier(kept.tier)):
                fastest[placement.adapter] = placement
        now = self._now_ms()
        with self._transaction() as s:
            if s.get(WorkerRow, worker_id) is None:
                raise NotFound(f"worker {worker_id!r} is not registered")
            known = set(s.scalars(select(AdapterRow.name).where(AdapterRow.name.in_(list(fastest)))))
            s.execute(delete(PlacementRow).where(PlacementRow.worker_id == worker_id))
            rows = [PlacementRow(adapter=a, worker_id=worker_id, tier=Tier(p.tier).value, updated_ms=now,
                                 loading=p.loading, pinned=p.pinned)
                    for a, p in sorted(fastest.items()) if a in known]
            s.add_all(rows)
            s.flush()
            return [_placement_record(r) for r in rows]

    def list_placements(self, adapter: str | None = None, worker_id: str | None = None) -> list[PlacementRecord]:
        query = select(PlacementRow).order_by(PlacementRow.adapter, PlacementRow.worker_id)
        if adapter:
            query = query.where(PlacementRow.adapter == adapter)
        if worker_id:
            query = query.where(PlacementRow.worker_id == worker_id)
        with self._transaction() as s:
            return [_placement_record(r) for r in s.scalars(query)]

    # Placement orders (an operator's pins and preloads)

    def place_adapter(self, name: str, worker_ids: Sequence[str] | None, pin: bool) -> list[PlacementOrderRecord]:
        """Order `name` onto the workers `worker_ids` (None: every worker of its base model, those that
        register later included), pinned or preloaded; an order already there takes the new `pin`.
        Returns the adapter's orders."""
        now = self._now_ms()
        with self._transaction() as s:
            adapter = _get_adapter_row(s, name)
            addresses = {"all": ""} if worker_ids is None else _worker_addresses(s, worker_ids, adapter.base_model)
            existing = {r.worker_address: r for r in s.scalars(
                select(PlacementOrderRow).where(PlacementOrderRow.adapter == name))}
            for address in addresses.values():
                if address in existing:
                    existing[address].pin = pin
                else:
                    s.add(PlacementOrderRow(adapter=name, worker_address=address, pin=pin, created_ms=now))
            s.flush()
            return _orders_of(s, name)

    def list_placement_orders(self, name: str) -> list[PlacementOrderRecord]:
        with self._transaction() as s:
            _get_adapter_row(s, name)
            return _orders_of(s, name)

    def remove_placement_orders(self, name: str, worker_ids: Sequence[str] | None) -> list[PlacementOrderRecord]:
        """Lift the orders of `name` on `worker_ids` (None: its every-worker order); their pins go. NotFound
        if one of them has none. Returns the orders removed."""
        with self._transaction() as s:
            adapter = _get_adapter_row(s, name)
            addresses = {"all": ""} if worker_ids is None else _worker_addresses(s, worker_ids, adapter.base_model)
            rows = {r.worker_address: r for r in s.scalars(select(PlacementOrderRow).where(
                PlacementOrderRow.adapter == name, PlacementOrderRow.worker_address.in_(list(addresses.values()))))}
            missing = [target for target, address in addresses.items() if address not in rows]
            if missing:
                raise NotFound(f"adapter {name!r} has no placement order for {', '.join(missing)}")
            removed = [_order_record(rows[a]) for a in addresses.values()]
            for row in rows.values():
                s.delete(row)
            return removed

    def worker_orders(self, worker_id: str, held: Sequence[AdapterVersion]) -> WorkerOrders:
        """What the registry asks of a worker holding the versions `held`: to retire those the registry
        no longer serves under their name (deleted, or registered again with other weights), and to
        hold the adapters operators ordered onto it (pinned if any order that reaches it pins)."""
        with self._transaction() as s:
            worker = s.get(WorkerRow, worker_id)
            if worker is None:
                raise NotFound(f"worker {worker_id!r} is not registered")
            names = sorted({name for name, _ in held})
            serving = dict(s.execute(select(AdapterRow.name, AdapterRow.sha256).where(AdapterRow.name.in_(names))).all())
            retire = tuple(sorted(version for version in set(held) if serving.get(version[0]) != version[1]))
            ordered = s.execute(
                select(AdapterRow, PlacementOrderRow.pin).join(PlacementOrderRow, PlacementOrderRow.adapter == AdapterRow.name)
                .where(AdapterRow.base_model == worker.base_model,
                       PlacementOrderRow.worker_address.in_(["", worker.address]))
                .order_by(AdapterRow.name)).all()
            adapters: dict[str, AdapterRecord] = {}
            pins: dict[str, bool] = {}  # an adapter ordered onto the worker and onto all its base model's
            for row, pin in ordered:
                adapters[row.name] = _adapter_record(row)
                pins[row.name] = pins.get(row.name, False) or pin
            planned = s.execute(
                select(AdapterRow, PlannedPlacementRow.tier, PlannedPlacementRow.rate)
                .join(PlannedPlacementRow, PlannedPlacementRow.adapter == AdapterRow.name)
                .where(AdapterRow.base_model == worker.base_model, PlannedPlacementRow.worker_address == worker.address)
                .order_by(AdapterRow.name)).all()
            host: list[AdapterRecord] = []
            rates: dict[str, float] = {}
            for row, tier, rate in planned:  # the planner's preloads, where no operator's order says more
                if row.name in adapters:
                    continue
                rates[row.name] = rate
                if tier == "gpu":
                    adapters[row.name], pins[row.name] = _adapter_record(row), False
                else:
                    host.append(_adapter_record(row))
            return WorkerOrders(retire=retire, placements=tuple((adapters[n], pins[n]) for n in sorted(adapters)),
                                host_placements=tuple(host), planned_rates=rates)

    # The placement planner's decisions (registry/placement_planner.py)

    def placement_inputs(self, base_model: str) -> PlacementInputs:
        """What `base_model`'s placement is planned from: its healthy workers (their heartbeats' stats carry
        tier budgets and the requests each adapter brought), its adapters' sizes, and where each is held."""
        workers = self.list_workers(base_model, healthy_only=True)
        addresses = {w.worker_id: w.address for w in workers}
        with self._transaction() as s:
            sizes = dict(s.execute(select(AdapterRow.name, AdapterRow.size_bytes)
                                   .where(AdapterRow.base_model == base_model)).all())
            held: dict[Tier, dict[str, set[str]]] = {Tier.GPU: {}, Tier.HOST: {}}
            for adapter, worker_id, tier, loading in s.execute(
                    select(PlacementRow.adapter, PlacementRow.worker_id, PlacementRow.tier, PlacementRow.loading)
                    .where(PlacementRow.worker_id.in_(list(addresses)))):
                if not loading and Tier(tier) in held:
                    held[Tier(tier)].setdefault(adapter, set()).add(addresses[worker_id])
        frozen = {tier: {a: frozenset(ws) for a, ws in by.items()} for tier, by in held.items()}
        return PlacementInputs(tuple(workers), sizes, frozen[Tier.GPU], frozen[Tier.HOST])

    def replace_planned_placements(self, base_model: str, gpu: Mapping[str, Sequence[str]],
                                   host: Mapping[str, Sequence[str]], rates: Mapping[str, float]) -> None:
        """`base_model`'s plan, replacing its last: adapter -> worker addresses, on the GPU or in host memory;
        `rates`: adapter -> requests/s, split evenly over its GPU replicas. Adapters deleted since they were
        planned are left out."""
        now = self._now_ms()
        with self._transaction() as s:
            names = set(s.scalars(select(AdapterRow.name).where(AdapterRow.base_model == base_model)))
            s.execute(delete(PlannedPlacementRow).where(PlannedPlacementRow.adapter.in_(names)))
            for tier, placed in (("gpu", gpu), ("host", host)):
                for adapter, workers in placed.items():
                    if adapter in names:
                        share = float(rates.get(adapter, 0.0)) / max(1, len(workers))
                        s.add_all(PlannedPlacementRow(adapter=adapter, worker_address=w, tier=tier, rate=share,
                                                      planned_ms=now) for w in workers)

    def clear_planned_placements(self) -> None:
        """Forget every plan (placement planning is off: no worker is asked for a planned preload)."""
        with self._transaction() as s:
            s.execute(delete(PlannedPlacementRow))

    def list_planned_placements(self, base_model: str | None = None) -> list[PlannedPlacementRecord]:
        query = select(PlannedPlacementRow).order_by(PlannedPlacementRow.adapter, PlannedPlacementRow.worker_address)
        if base_model:
            query = query.join(AdapterRow, AdapterRow.name == PlannedPlacementRow.adapter).where(
                AdapterRow.base_model == base_model)
        with self._transaction() as s:
            return [PlannedPlacementRecord(r.adapter, r.worker_address, r.tier, r.rate, r.planned_ms)
                    for r in s.scalars(query)]


def _insert(session: Session, row: Any, what: str) -> None:
    """Add and flush `row`; a unique-constraint race surfaces as AlreadyExists."""
    session.add(row)
    try:
        session.flush()
    except IntegrityError as exc:
        raise AlreadyExists(f"{what} already exists") from exc


def _get_base_model_row(session: Session, name: str) -> BaseModelRow:
    row = session.scalar(select(BaseModelRow).where(BaseModelRow.name == name))
    if row is None:
        raise NotFound(f"base model {name!r} is not registered")
    return row


def _get_adapter_row(session: Session, name: str) -> AdapterRow:
    row = session.scalar(select(AdapterRow).where(AdapterRow.name == name))
    if row is None:
        raise NotFound(f"adapter {name!r} is not registered")
    return row


def _worker_addresses(session: Session, worker_ids: Sequence[str], base_model: str) -> dict[str, str]:
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


def _orders_of(session: Session, adapter: str) -> list[PlacementOrderRecord]:
    query = select(PlacementOrderRow).where(PlacementOrderRow.adapter == adapter).order_by(
        PlacementOrderRow.worker_address)
    return [_order_record(r) for r in session.scalars(query)]


def _check_adapter_name_free(session: Session, name: str) -> None:
    if session.scalar(select(AdapterRow.id).where(AdapterRow.name == name)) is not None:
        raise AlreadyExists(f"adapter {name!r} already exists")
    if session.scalar(select(BaseModelRow.id).where(BaseModelRow.name == name)) is not None:
        raise AlreadyExists(f"{name!r} is already a base model's name; an adapter may not take it "
                            "(requests name a base model or an adapter in the same `model` field)")
