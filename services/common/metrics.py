"""Prometheus metrics: each role serves its registry on its own metrics port."""

from __future__ import annotations

import logging

from prometheus_client import start_http_server

log = logging.getLogger(__name__)

# Latency buckets (seconds) wide enough for CPU demo models and GPU serving alike.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def start_metrics_server(host: str, port: int) -> None:
    """Serve /metrics on host:port in a daemon thread (port 0 disables metrics)."""
    if port == 0:
        return
    start_http_server(port, addr=host)
    log.info("metrics on http://%s:%d/metrics", host, port)
