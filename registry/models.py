"""SQLAlchemy 2.x models of the registry schema (portable types only: SQLite or PostgreSQL).

Times are integer unix milliseconds (BigInteger) rather than DateTime, so the
value read back is the value written on every backend, with no timezone rules.
The hand-written migration in migrations/versions must match these exactly
(tests compare them with alembic's `compare_metadata`).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, ForeignKey, Integer, MetaData, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Deterministic constraint names, so migrations can refer to them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class BaseModelRow(Base):
    __tablename__ = "base_models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    architecture: Mapped[str] = mapped_column(String(128))
    path: Mapped[str] = mapped_column(String(4096))
    max_context: Mapped[int] = mapped_column(Integer)
    vocab_size: Mapped[int] = mapped_column(Integer)
    hidden_size: Mapped[int] = mapped_column(Integer)
    num_layers: Mapped[int] = mapped_column(Integer)
    # {"q_proj": {"in_features": 4096, "out_features": 4096}, ...} for every targetable projection.
    module_shapes: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_ms: Mapped[int] = mapped_column(BigInteger)


class AdapterRow(Base):
    __tablename__ = "adapters"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    base_model: Mapped[str] = mapped_column(
        String(128), ForeignKey("base_models.name", ondelete="RESTRICT"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    storage_path: Mapped[str] = mapped_column(String(4096))
    created_ms: Mapped[int] = mapped_column(BigInteger)
    task_head: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # The adapter's default objectives (ms) for requests that name none; NULL: the gateway's.
    tpot_slo_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    ttft_slo_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Its LoRA parameters on the vision tower and projector (services/common/tower_lora.py); 0: none.
    tower_lora_params: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # The tasks it serves, as `tessera fuse` measured them: [{"name", "accuracy", "metric"}, ...]; NULL: none named.
    tasks: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)


class WorkerRow(Base):
    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)  # uuid4, fresh per registration
    address: Mapped[str] = mapped_column(String(256), unique=True)
    device: Mapped[str] = mapped_column(String(64))
    # Not a foreign key: a worker reports what it serves, even before an admin registers that base model.
    base_model: Mapped[str] = mapped_column(String(128), index=True)
    capacity: Mapped[int] = mapped_column(Integer)
    last_heartbeat_ms: Mapped[int] = mapped_column(BigInteger)
    stats: Mapped[dict[str, Any]] = mapped_column(JSON)


class PlacementRow(Base):
    __tablename__ = "placements"
    __table_args__ = (UniqueConstraint("adapter", "worker_id", name="uq_placements_adapter_worker"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    adapter: Mapped[str] = mapped_column(String(128), ForeignKey("adapters.name", ondelete="CASCADE"))
    worker_id: Mapped[str] = mapped_column(
        String(36), ForeignKey("workers.id", ondelete="CASCADE"), index=True)
    tier: Mapped[str] = mapped_column(String(16))  # a records.Tier value
    updated_ms: Mapped[int] = mapped_column(BigInteger)
    loading: Mapped[bool] = mapped_column(Boolean, default=False)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)


class PlacementOrderRow(Base):
    """An operator's pin or preload of an adapter on a worker, kept until the operator lifts it."""

    __tablename__ = "placement_orders"
    __table_args__ = (UniqueConstraint("adapter", "worker_address", name="uq_placement_orders_adapter_worker"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    adapter: Mapped[str] = mapped_column(String(128), ForeignKey("adapters.name", ondelete="CASCADE"))
    # By address, not worker id: a restarted worker registers again under a new id at the same
    # address and keeps its orders. "" (not NULL, which a unique constraint never matches): every
    # worker of the adapter's base model.
    worker_address: Mapped[str] = mapped_column(String(256))
    pin: Mapped[bool] = mapped_column(Boolean)
    created_ms: Mapped[int] = mapped_column(BigInteger)


class PlannedPlacementRow(Base):
    """The placement planner's decision for one adapter on one worker (registry/placement_planner.py):
    replaced whole at each plan of its base model, carried out by the worker as a preload."""

    __tablename__ = "planned_placements"
    __table_args__ = (UniqueConstraint("adapter", "worker_address", name="uq_planned_placements_adapter_worker"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    adapter: Mapped[str] = mapped_column(String(128), ForeignKey("adapters.name", ondelete="CASCADE"))
    worker_address: Mapped[str] = mapped_column(String(256))
    tier: Mapped[str] = mapped_column(String(16))  # "gpu" (a hot adapter's replica) or "host" (a warm one)
    rate: Mapped[float] = mapped_column(Float)      # the requests/s of it the plan expects this worker to serve
    planned_ms: Mapped[int] = mapped_column(BigInteger)
