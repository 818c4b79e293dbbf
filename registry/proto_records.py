"""Conversions between registry records and tessera.v1 protos: the only place that knows both."""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format

from registry.records import (AdapterRecord, AdapterVersion, BaseModelRecord, PlacementRecord, ReportedPlacement, Tier,
                              WorkerOrders, WorkerRecord)
from services.common.errors import InvalidArgument
from tessera.v1 import common_pb2, registry_pb2

TIER_TO_PROTO: dict[Tier, int] = {
    Tier.GPU: common_pb2.TIER_GPU, Tier.HOST: common_pb2.TIER_HOST, Tier.DISK: common_pb2.TIER_DISK}
TIER_FROM_PROTO: dict[int, Tier] = {v: k for k, v in TIER_TO_PROTO.items()}


def base_model_to_proto(record: BaseModelRecord) -> common_pb2.BaseModel:
    return common_pb2.BaseModel(
        name=record.name, architecture=record.architecture, path=record.path,
        max_context=record.max_context, vocab_size=record.vocab_size,
        created_unix=record.created_unix_ms // 1000)


def adapter_to_proto(record: AdapterRecord) -> common_pb2.Adapter:
    return common_pb2.Adapter(
        name=record.name, base_model=record.base_model, rank=record.rank, alpha=record.alpha,
        target_modules=list(record.target_modules), size_bytes=record.size_bytes, sha256=record.sha256,
        storage_path=record.storage_path, created_unix=record.created_unix_ms // 1000,
        created_unix_ms=record.created_unix_ms,
        task_head_json=json.dumps(record.task_head) if record.task_head is not None else "",
        tpot_slo_ms=record.tpot_slo_ms or 0.0, ttft_slo_ms=record.ttft_slo_ms or 0.0,
        tower_lora_params=record.tower_lora_params,
        tasks=[common_pb2.AdapterTask(name=t.name, accuracy=t.accuracy, metric=t.metric) for t in record.tasks])


def stats_to_dict(stats: common_pb2.WorkerStats) -> dict[str, Any]:
    """Every field, zeros included (the admin API's /workers shows them as they are); a repeated message
    field as a list of objects of its fields."""
    def value(field: Any) -> Any:
        got = getattr(stats, field.name)
        if not field.is_repeated:
            return got
        if field.message_type is None:
            return list(got)
        return [{f.name: getattr(item, f.name) for f in item.DESCRIPTOR.fields} for item in got]
    return {field.name: value(field) for field in stats.DESCRIPTOR.fields}


def stats_from_dict(stats: dict[str, Any]) -> common_pb2.WorkerStats:
    # ignore_unknown_fields: rows written by another contract version still load.
    return json_format.ParseDict(stats, common_pb2.WorkerStats(), ignore_unknown_fields=True)


def worker_to_proto(record: WorkerRecord) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(
        worker_id=record.worker_id, address=record.address, device=record.device,
        base_model=record.base_model, capacity=record.capacity,
        last_heartbeat_unix_ms=record.last_heartbeat_unix_ms, healthy=record.healthy,
        stats=stats_from_dict(record.stats))


def placement_to_proto(record: PlacementRecord) -> common_pb2.Placement:
    return common_pb2.Placement(adapter=record.adapter, worker_id=record.worker_id,
                                tier=TIER_TO_PROTO[record.tier], updated_unix_ms=record.updated_unix_ms,
                                loading=record.loading, pinned=record.pinned)


def placement_from_proto(placement: common_pb2.Placement, worker_id: str) -> ReportedPlacement:
    if placement.worker_id and placement.worker_id != worker_id:
        raise InvalidArgument(f"placement of {placement.adapter!r} names worker {placement.worker_id!r}, "
                              f"not the reporting worker {worker_id!r}")
    if placement.tier not in TIER_FROM_PROTO:
        raise InvalidArgument(f"placement of {placement.adapter!r} has no tier")
    return ReportedPlacement(placement.adapter, TIER_FROM_PROTO[placement.tier], placement.loading, placement.pinned)


def versions_from_proto(versions: list[registry_pb2.AdapterVersion]) -> list[AdapterVersion]:
    return [(v.name, v.sha256) for v in versions]


def orders_to_proto(orders: WorkerOrders) -> registry_pb2.HeartbeatResponse:
    """A known worker's heartbeat answer."""
    return registry_pb2.HeartbeatResponse(
        known=True, retire=[registry_pb2.AdapterVersion(name=name, sha256=sha256) for name, sha256 in orders.retire],
        placements=[registry_pb2.PlacementOrder(adapter=adapter_to_proto(adapter), pin=pin,
                                                expected_rate=orders.planned_rates.get(adapter.name, 0.0))
                    for adapter, pin in orders.placements]
        + [registry_pb2.PlacementOrder(adapter=adapter_to_proto(adapter), host_only=True,
                                       expected_rate=orders.planned_rates.get(adapter.name, 0.0))
           for adapter in orders.host_placements])
