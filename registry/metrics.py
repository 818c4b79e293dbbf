"""Prometheus metrics of the registry role."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

ADAPTERS_REGISTERED = Counter("tessera_registry_adapters_registered_total", "Adapters registered through the admin API")
ADMIN_REQUESTS = Counter("tessera_registry_admin_requests_total", "Admin API requests by HTTP status", ["status"])
# The placement planner's last plan of each base model (registry/placement_planner.py).
PLANNED_ADAPTERS = Gauge("tessera_registry_planned_adapters", "Adapters the last placement plan put in a tier",
                         ["base_model", "tier"])
PLANNED_GPU_REPLICAS = Gauge("tessera_registry_planned_gpu_replicas", "GPU replicas of the last placement plan",
                             ["base_model"])
PLANNER_LEASE = Gauge("tessera_registry_placement_planner", "1 while this replica holds the planner's lease "
                      "and plans placements (one replica of those sharing a database), else 0")
PLACEMENT_MOVES = Counter("tessera_registry_placement_moves_total",
                          "Replicas placement plans added over the plan before", ["base_model"])
