"""The registry's catalog: base models and adapters, their names, their stored files, and the feed
that tells gateways (and the other replicas) when it changes."""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from registry.adapter_blobs import AdapterBlobStore
from registry.adapter_files import locate_adapter_files, validate_adapter_dir
from registry.base_model_files import read_base_model_spec
from registry.catalog_feed import CatalogFeed
from registry.catalog_relay import announce
from registry.models import AdapterRow, BaseModelRow, PlacementOrderRow, PlacementRow
from registry.records import TASK_METRICS, AdapterRecord, AdapterTask, BaseModelRecord, CatalogChange, ModuleShape
from registry.store_base import StoreBase, insert_row
from registry.store_lock import StoreLock
from registry.trusted_paths import real_roots, resolve_inside_roots
from services.common.errors import AlreadyExists, InvalidArgument, NotFound
from services.common.slo import check_slo_ms

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
TASK_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")  # docs/fuse.md's task names
# Requests name a task as "task:<name>" in the `model` field (the gateway's registry_cache.py): no model may.
TASK_MODEL_PREFIX = "task:"


def check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidArgument(
            f"{what} name {name!r} is invalid: use 1-128 characters from letters, digits and . _ : -, "
            "starting with a letter or digit")
    if name.startswith(TASK_MODEL_PREFIX):
        raise InvalidArgument(f"{what} name {name!r} is invalid: {TASK_MODEL_PREFIX!r} starts a task's name in "
                              "requests (docs/fuse.md, \"Routing by task\")")
    return name


def check_tasks(tasks: Sequence[AdapterTask]) -> tuple[AdapterTask, ...]:
    """The tasks an adapter serves, each checked; InvalidArgument naming the field ("tasks[1].accuracy")."""
    seen: set[str] = set()
    for i, task in enumerate(tasks):
        field = f"tasks[{i}]"
        if not isinstance(task.name, str) or not TASK_NAME_PATTERN.fullmatch(task.name):
            raise InvalidArgument(f"{field}.name {task.name!r} is invalid: use 1-63 characters from a-z, 0-9 and -, "
                                  "starting with a letter or digit", param=f"{field}.name")
        if task.name in seen:
            raise InvalidArgument(f"{field}.name {task.name!r} is named twice", param=f"{field}.name")
        seen.add(task.name)
        accuracy = task.accuracy
        if (isinstance(accuracy, bool) or not isinstance(accuracy, (int, float)) or not math.isfinite(accuracy)
                or not 0 <= accuracy <= 1):
            raise InvalidArgument(f"{field}.accuracy must be a number in [0, 1], got {accuracy!r}",
                                  param=f"{field}.accuracy")
        if task.metric not in TASK_METRICS:
            raise InvalidArgument(f"{field}.metric {task.metric!r} is not one of {', '.join(TASK_METRICS)}",
                                  param=f"{field}.metric")
    return tuple(AdapterTask(t.name, float(t.accuracy), t.metric) for t in tasks)


def base_model_record(row: BaseModelRow) -> BaseModelRecord:
    return BaseModelRecord(
        name=row.name, architecture=row.architecture, path=row.path, max_context=row.max_context,
        vocab_size=row.vocab_size, hidden_size=row.hidden_size, num_layers=row.num_layers,
        module_shapes={m: ModuleShape(**shape) for m, shape in row.module_shapes.items()},
        created_unix_ms=row.created_ms)


def adapter_record(row: AdapterRow) -> AdapterRecord:
    return AdapterRecord(
        name=row.name, base_model=row.base_model, rank=row.rank, alpha=row.alpha,
        target_modules=tuple(row.target_modules), size_bytes=row.size_bytes, sha256=row.sha256,
        storage_path=row.storage_path, created_unix_ms=row.created_ms, task_head=row.task_head,
        tpot_slo_ms=row.tpot_slo_ms, ttft_slo_ms=row.ttft_slo_ms, tower_lora_params=row.tower_lora_params,
        tasks=tuple(AdapterTask(**task) for task in row.tasks or ()))


def _checked_slos(tpot_slo_ms: float | None, ttft_slo_ms: float | None) -> tuple[float | None, float | None]:
    return (None if tpot_slo_ms is None else check_slo_ms(tpot_slo_ms, "tpot_slo_ms"),
            None if ttft_slo_ms is None else check_slo_ms(ttft_slo_ms, "ttft_slo_ms"))


class CatalogStore(StoreBase):
    def _init_catalog(self, adapter_store: Path, import_roots: list[Path], deleted_files_grace_s: float) -> None:
        """Called once by RegistryStore.__init__, after StoreBase's."""
        self._blobs = AdapterBlobStore(adapter_store)
        self._roots = real_roots(import_roots)
        self._deleted_files_grace_s = deleted_files_grace_s
        # Serialises each write with the check before it that another row allows it: blob commits and
        # removals with the rows that reference them (dedup vs delete), and a new name against both the
        # adapters and the base models (requests name either in one `model` field); across replicas too.
        self._blob_lock = StoreLock(adapter_store)
        self.changes = CatalogFeed()  # published after each commit that changes the catalog
        self.replica = uuid.uuid4().hex  # this store among the registry replicas on one database

    def _announce(self, change: CatalogChange) -> None:
        """Tell this registry's catalog watchers, and on PostgreSQL the other replicas' (catalog_relay.py)."""
        self.changes.publish(change)
        if self._engine.dialect.name == "postgresql":
            with self._engine.begin() as connection:
                announce(connection, change, self.replica)

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
            insert_row(s, row, f"base model {name!r}")
            record = base_model_record(row)
        self._announce(CatalogChange())
        return record

    def get_base_model(self, name: str) -> BaseModelRecord:
        with self._transaction() as s:
            return base_model_record(_get_base_model_row(s, name))

    def list_base_models(self) -> list[BaseModelRecord]:
        with self._transaction() as s:
            return [base_model_record(r) for r in s.scalars(select(BaseModelRow).order_by(BaseModelRow.name))]

    # Adapters

    def register_adapter(self, name: str, base_model: str, source_dir: str, tpot_slo_ms: float | None = None,
                         ttft_slo_ms: float | None = None,
                         tasks: Sequence[AdapterTask] | None = None) -> AdapterRecord:
        """Validate the PEFT adapter in `source_dir` against `base_model` and import it by content, with the
        task head its files carry (services/common/task_heads.py), derived anew at every registration.
        `tpot_slo_ms`, `ttft_slo_ms`: its default objectives for requests that name none. `tasks`: the tasks it
        serves; another adapter may serve one too, and then requests for it go to the newer registration
        (docs/fuse.md, "Routing by task").

        The files are copied into a staging directory first and validated there,
        so the stored bytes are exactly the validated ones.
        """
        check_name(name, "adapter")
        tpot_slo_ms, ttft_slo_ms = _checked_slos(tpot_slo_ms, ttft_slo_ms)
        checked_tasks = check_tasks(tasks or ())
        with self._transaction() as s:
            base = base_model_record(_get_base_model_row(s, base_model))
            _check_adapter_name_free(s, name)
        staged = self._blobs.stage(locate_adapter_files(source_dir, self._roots))
        with self._blob_lock:
            try:
                spec = validate_adapter_dir(staged.directory, base)
                with self._transaction() as s:
                    _check_adapter_name_free(s, name)
                    storage = self._blobs.commit(staged)
                    row = AdapterRow(
                        name=name, base_model=base.name, rank=spec.rank, alpha=spec.alpha,
                        target_modules=list(spec.target_modules), size_bytes=staged.size_bytes,
                        sha256=staged.sha256, storage_path=str(storage), created_ms=self._now_ms(),
                        task_head=spec.task_head.to_json() if spec.task_head is not None else None,
                        tpot_slo_ms=tpot_slo_ms, ttft_slo_ms=ttft_slo_ms, tower_lora_params=spec.tower_lora_params,
                        tasks=[{"name": t.name, "accuracy": t.accuracy, "metric": t.metric} for t in checked_tasks]
                        or None)
                    insert_row(s, row, f"adapter {name!r}")
                    record = adapter_record(row)
            except BaseException:
                self._blobs.discard(staged)
                self._retire_blob_if_unreferenced(str(self._blobs.path_for(staged.sha256)))
                raise
        self._announce(CatalogChange())
        return record

    def get_adapter(self, name: str) -> AdapterRecord:
        with self._transaction() as s:
            return adapter_record(get_adapter_row(s, name))

    def list_adapters(self, base_model: str | None = None) -> list[AdapterRecord]:
        query = select(AdapterRow).order_by(AdapterRow.name)
        if base_model:
            query = query.where(AdapterRow.base_model == base_model)
        with self._transaction() as s:
            return [adapter_record(r) for r in s.scalars(query)]

    def set_adapter_slos(self, name: str, tpot_slo_ms: float | None, ttft_slo_ms: float | None) -> AdapterRecord:
        """Replace the adapter's default objectives (None: the gateway's); the gateways take them at once."""
        tpot_slo_ms, ttft_slo_ms = _checked_slos(tpot_slo_ms, ttft_slo_ms)
        with self._transaction() as s:
            row = get_adapter_row(s, name)
            row.tpot_slo_ms, row.ttft_slo_ms = tpot_slo_ms, ttft_slo_ms
            record = adapter_record(row)
        self._announce(CatalogChange())
        return record

    def delete_adapter(self, name: str) -> None:
        """Remove the adapter, its placements and placement orders; its stored files go once no adapter
        shares them, after the grace the worker's queued requests may need them for. The gateways stop
        resolving it at once (`changes`); workers drop it from their tiers once its in-flight requests
        end (`worker_orders` tells them to)."""
        with self._blob_lock:
            with self._transaction() as s:
                row = get_adapter_row(s, name)
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


def _get_base_model_row(session: Session, name: str) -> BaseModelRow:
    row = session.scalar(select(BaseModelRow).where(BaseModelRow.name == name))
    if row is None:
        raise NotFound(f"base model {name!r} is not registered")
    return row


def get_adapter_row(session: Session, name: str) -> AdapterRow:
    row = session.scalar(select(AdapterRow).where(AdapterRow.name == name))
    if row is None:
        raise NotFound(f"adapter {name!r} is not registered")
    return row


def _check_adapter_name_free(session: Session, name: str) -> None:
    if session.scalar(select(AdapterRow.id).where(AdapterRow.name == name)) is not None:
        raise AlreadyExists(f"adapter {name!r} already exists")
    if session.scalar(select(BaseModelRow.id).where(BaseModelRow.name == name)) is not None:
        raise AlreadyExists(f"{name!r} is already a base model's name; an adapter may not take it "
                            "(requests name a base model or an adapter in the same `model` field)")
