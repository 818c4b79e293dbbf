"""The gateway's REST server under load, bounded for CI (the full run: benchmarks/gateway_load.py,
docs/benchmarks/gateway.md): a second gateway with admission bound BOUND in front of the system's
worker takes 2 x BOUND concurrent SSE streams at once, then serves a normal request beside IDLE idle
connections. Streams are raw asyncio sockets; the gateway's own in-flight gauge says when it has
admitted a request. The registry's admin port, on the same server helper, keeps the same bound on
idle connections (waitress, its old server, let 120 of them time admin requests out)."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterator
from urllib.parse import urlsplit
from dataclasses import dataclass

import pytest

from benchmarks.gateway_load import completion_request, idle_delay, load, sse_stream
from benchmarks.harness.live_system import RunningSystem, spawn_role, stop_role
from benchmarks.harness.ports import free_port

pytestmark = pytest.mark.integration

BOUND = 100  # the second gateway's max_queued_per_model
STREAMS = 2 * BOUND
IDLE = 100
ADMIN_IDLE = 150  # past waitress's 100 connections


@dataclass
class BoundedGateway:
    http_port: int
    metrics_port: int


@pytest.fixture(scope="module")
def gateway(system: RunningSystem) -> Iterator[BoundedGateway]:
    ports = {name: free_port() for name in ("GATEWAY__HTTP_PORT", "GATEWAY__GRPC_PORT", "GATEWAY__METRICS_PORT")}
    env = {**system.env, **{f"TESSERA_{k}": str(v) for k, v in ports.items()},
           "TESSERA_GATEWAY__MAX_QUEUED_PER_MODEL": str(BOUND)}
    with open(system.home / "gateway-load-test.log", "w") as log:
        process = spawn_role("gateway", env, log)
        try:
            system.wait_healthy(f"127.0.0.1:{ports['GATEWAY__GRPC_PORT']}", "gateway", timeout_s=60)
            http_port = ports["GATEWAY__HTTP_PORT"]
            for _ in range(100):  # until its registry cache knows the worker
                if asyncio.run(sse_stream(http_port, completion_request(http_port, 1), 30)).done:
                    break
            else:
                raise AssertionError("the second gateway never served a stream")
            yield BoundedGateway(http_port, ports["GATEWAY__METRICS_PORT"])
        finally:
            stop_role(process)


def test_streams_past_the_bound_complete_or_get_429_at_once_and_none_waits_unadmitted(gateway: BoundedGateway) -> None:
    run = asyncio.run(load(gateway.http_port, gateway.metrics_port, STREAMS, max_tokens=8, timeout_s=120))

    assert not run.failed, f"{len(run.failed)} streams neither completed nor got 429: {run.failed[:3]}"
    assert run.completed + run.refused == STREAMS
    assert run.completed >= BOUND, "every place under the bound serves a stream"
    assert run.refused > 0, f"{STREAMS} streams at once against a bound of {BOUND}: the rest are refused"
    refused = [s for s in run.streams if s.status == 429]
    assert all(s.retry_after is not None and int(s.retry_after) >= 1 for s in refused)
    # The yardstick, measured in this run (so a busy machine moves it with the gateway): how long an
    # admitted stream takes. A request that waited for a place would wait for admitted streams to end.
    stream_s = statistics.median(s.done_s for s in run.streams if s.done_s is not None)
    assert max(s.ttft_s for s in refused) < stream_s, "a refusal comes at once, not after a wait for a place"
    # No request waits unadmitted: all are admitted or refused before a typical admitted stream has ended
    # (a thread per stream would leave all but its pool size waiting for streams to end).
    assert run.all_decided_s is not None and run.all_decided_s < stream_s, (run.all_decided_s, stream_s)


def test_idle_connections_delay_a_normal_request_by_less_than_100_ms(gateway: BoundedGateway) -> None:
    alone_s, beside_idle_s, still_open = asyncio.run(idle_delay(gateway.http_port, IDLE))

    assert still_open == IDLE, "the idle connections were held open while the request was served"
    assert beside_idle_s - alone_s < 0.1, (alone_s, beside_idle_s)


def test_idle_connections_delay_an_admin_request_by_less_than_100_ms(system: RunningSystem) -> None:
    admin = urlsplit(system.admin_base)
    alone_s, beside_idle_s, still_open = asyncio.run(idle_delay(
        admin.port, ADMIN_IDLE, path=f"{admin.path}/adapters", headers=f"Authorization: Bearer {system.admin_key}\r\n"))

    assert still_open == ADMIN_IDLE, "the idle connections were held open while the request was served"
    assert beside_idle_s - alone_s < 0.1, (alone_s, beside_idle_s)
