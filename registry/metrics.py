"""Prometheus metrics of the registry role."""

from __future__ import annotations

from prometheus_client import Counter

ADAPTERS_REGISTERED = Counter("tessera_registry_adapters_registered_total", "Adapters registered through the admin API")
ADMIN_REQUESTS = Counter("tessera_registry_admin_requests_total", "Admin API requests by HTTP status", ["status"])
