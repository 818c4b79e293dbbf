"""Where adapters are and should be: the placements workers report, the placement orders operators
give (pins and preloads), and the plans of the placement planner (registry/placement_planner.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from registry.catalog_store import adapter_record, get_adapter_row
from registry.models import AdapterRow, PlacementOrderRow, PlacementRow, PlannedPlacementRow, WorkerRow
from registry.records import (AdapterRecord, AdapterVersion, PlacementInputs, PlacementOrderRecord, PlacementRecord,
                              PlannedPlacementRecord, ReportedPlacement, Tier, WorkerOrders)
from registry.worker_store import WorkerStore, worker_addresses
from services.common.errors import NotFound

TIER_ORDER = list(Tier)  # fastest first


def _placement_record(row: PlacementRow) -> PlacementRecord:
    return PlacementRecord(adapter=row.adapter, worker_id=row.worker_id, tier=Tier(row.tier),
                           updated_unix_ms=row.updated_ms, loading=row.loading, pinned=row.pinned)


def _order_record(row: PlacementOrderRow) -> PlacementOrderRecord:
    return PlacementOrderRecord(adapter=row.adapter, worker_address=row.worker_address or None, pin=row.pin,
                                created_unix_ms=row.created_ms)


class PlacementStore(WorkerStore):
    """Built on WorkerStore: a placement is a worker's (reported by it, ordered or planned onto it), and
    `placement_inputs` reads the healthy workers."""

    # Placements the workers report

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
            adapter = get_adapter_row(s, name)
            addresses = {"all": ""} if worker_ids is None else worker_addresses(s, worker_ids, adapter.base_model)
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
            get_adapter_row(s, name)
            return _orders_of(s, name)

    def remove_placement_orders(self, name: str, worker_ids: Sequence[str] | None) -> list[PlacementOrderRecord]:
        """Lift the orders of `name` on `worker_ids` (None: its every-worker order); their pins go. NotFound
        if one of them has none. Returns the orders removed."""
        with self._transaction() as s:
            adapter = get_adapter_row(s, name)
            addresses = {"all": ""} if worker_ids is None else worker_addresses(s, worker_ids, adapter.base_model)
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
                adapters[row.name] = adapter_record(row)
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
                    adapters[row.name], pins[row.name] = adapter_record(row), False
                else:
                    host.append(adapter_record(row))
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


def _orders_of(session: Session, adapter: str) -> list[PlacementOrderRecord]:
    query = select(PlacementOrderRow).where(PlacementOrderRow.adapter == adapter).order_by(
        PlacementOrderRow.worker_address)
    return [_order_record(r) for r in session.scalars(query)]
