"""The gateway's Prometheus metrics (served by services.common.metrics.start_metrics_server)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from prometheus_client import Counter, Gauge, Histogram

from services.common.errors import TesseraError
from services.common.metrics import LATENCY_BUCKETS

REQUESTS = Counter("tessera_gateway_requests_total", "Requests by route and status", ["route", "status"])
IN_FLIGHT = Gauge("tessera_gateway_in_flight_requests", "Generate requests being served")
TIME_TO_FIRST_TOKEN = Histogram("tessera_gateway_time_to_first_token_seconds",
                                "From request accepted to first generated text", buckets=LATENCY_BUCKETS)
REQUEST_LATENCY = Histogram("tessera_gateway_request_latency_seconds",
                            "From request accepted to the final message", buckets=LATENCY_BUCKETS)
GENERATED_TOKENS = Counter("tessera_gateway_generated_tokens_total", "Tokens generated for clients")


@contextlib.contextmanager
def count_grpc_request(route: str) -> Iterator[None]:
    """Count one gRPC call under its final status code name (OK, NOT_FOUND, CANCELLED, ...)."""
    status = "OK"
    try:
        yield
    except TesseraError as exc:
        status = exc.grpc_code.name
        raise
    except asyncio.CancelledError:
        status = "CANCELLED"
        raise
    except Exception:
        status = "INTERNAL"
        raise
    finally:
        REQUESTS.labels(route=route, status=status).inc()
