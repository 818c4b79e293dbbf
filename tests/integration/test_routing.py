"""Live routing with real processes: the system's worker A, a second worker B and a second gateway
(admission bound QUEUE_BOUND) on the same registry. Which worker served a request is read from the
workers' own stats (generated tokens, resident adapters), and every expectation about the policy is
derived from the state the workers push, priced with the committed CPU perf model."""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import requests

from benchmarks.harness.live_system import RunningSystem, spawn_role, stop_role
from benchmarks.harness.ports import free_port
from gateway.core import routing_request
from gateway.registry_cache import ResolvedModel
from policy.perf_model import PERF_MODELS_DIR, load_perf_models
from policy.adapter_tiers import LoadCosts
from policy.routing.tessera_policy import TesseraPolicy
from gateway.state_feed import worker_state
from services.common.config import GatewayConfig
from tessera.v1 import common_pb2, inference_pb2, registry_pb2, registry_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.integration

BASE = "tessera-demo-llama"
QUEUE_BOUND = 3
LOOSE_SLO = {"tpot_ms": 60_000, "ttft_ms": 60_000}


@dataclass
class Cluster:
    system: RunningSystem
    worker_a: str
    worker_b: str
    http_base: str  # the second gateway's …/v1

    def adapter(self, name: str) -> common_pb2.Adapter:
        with self.system.internal_channel(self.system.registry_grpc) as channel:
            adapters = registry_pb2_grpc.RegistryStub(channel).ListAdapters(registry_pb2.ListAdaptersRequest())
        return next(a for a in adapters.adapters if a.name == name)

    def stats(self, worker: str) -> common_pb2.WorkerStats:
        with self.system.internal_channel(worker) as channel:
            return worker_pb2_grpc.WorkerServiceStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=10)

    def stats_counting(self, worker: str, generated: int, timeout_s: float = 5.0) -> common_pb2.WorkerStats:
        """`worker`'s stats once they count `generated` tokens or more: a worker publishes its stats just after
        the outputs they count, so a reply can reach the client first."""
        deadline = time.monotonic() + timeout_s
        while (stats := self.stats(worker)).generated_tokens_total < generated and time.monotonic() < deadline:
            time.sleep(0.02)
        return stats

    def state(self, worker: str, until: Callable[[worker_pb2.WorkerState], bool] = lambda s: True,
              timeout_s: float = 30.0) -> worker_pb2.WorkerState:
        """The first pushed state of `worker` that satisfies `until`."""
        deadline = time.monotonic() + timeout_s
        with self.system.internal_channel(worker) as channel:
            for state in worker_pb2_grpc.WorkerServiceStub(channel).WatchState(
                    worker_pb2.WatchStateRequest(interval_ms=20), timeout=timeout_s):
                if until(state) or time.monotonic() > deadline:
                    return state
        raise AssertionError(f"{worker} stopped pushing its state")

    def complete(self, model: str, prompt: str, max_tokens: int, slo: dict | None = None) -> requests.Response:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if slo is not None:
            body["tessera_slo"] = slo
        return requests.post(f"{self.http_base}/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def cluster(system: RunningSystem) -> Iterator[Cluster]:
    ports = {name: free_port() for name in ("WORKER__GRPC_PORT", "WORKER__METRICS_PORT", "GATEWAY__HTTP_PORT",
                                            "GATEWAY__GRPC_PORT", "GATEWAY__METRICS_PORT")}
    env = {**system.env, **{f"TESSERA_{k}": str(v) for k, v in ports.items()},
           "TESSERA_GATEWAY__MAX_QUEUED_PER_MODEL": str(QUEUE_BOUND)}
    log = open(system.home / "routing-test.log", "w")
    processes = []
    try:
        processes.append(spawn_role("worker", env, log))
        worker_b = f"127.0.0.1:{ports['WORKER__GRPC_PORT']}"
        system.wait_healthy(worker_b, "worker", timeout_s=120)
        processes.append(spawn_role("gateway", env, log))
        system.wait_healthy(f"127.0.0.1:{ports['GATEWAY__GRPC_PORT']}", "gateway", timeout_s=60)
        with system.internal_channel(system.registry_grpc) as channel:
            registry = registry_pb2_grpc.RegistryStub(channel)
            deadline = time.monotonic() + 60
            while len(registry.ListWorkers(registry_pb2.ListWorkersRequest(base_model=BASE, healthy_only=True),
                                           timeout=10).workers) < 2:
                assert time.monotonic() < deadline, "worker B never registered"
                time.sleep(0.2)
        yield Cluster(system, system.worker_grpc, worker_b, f"http://127.0.0.1:{ports['GATEWAY__HTTP_PORT']}/v1")
    finally:
        for process in reversed(processes):
            stop_role(process)
        log.close()


def _generate_on(system: RunningSystem, worker: str, adapter: common_pb2.Adapter, max_tokens: int) -> None:
    with system.internal_channel(worker) as channel:
        replies = list(worker_pb2_grpc.WorkerServiceStub(channel).Generate(worker_pb2.WorkerGenerateRequest(
            request_id=f"warm-{adapter.name}", base_model=BASE, adapter=adapter, text="warm up",
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens)), timeout=60))
    assert replies[-1].WhichOneof("payload") == "final"


def test_requests_for_an_adapter_resident_on_one_worker_go_to_it(cluster: Cluster) -> None:
    _generate_on(cluster.system, cluster.worker_a, cluster.adapter("demo-r16"), max_tokens=2)  # now resident on A
    a0, b0 = cluster.stats(cluster.worker_a), cluster.stats(cluster.worker_b)
    assert "demo-r16" in a0.resident_adapters and "demo-r16" not in b0.resident_adapters

    generated = 0
    for i in range(3):
        reply = cluster.complete("demo-r16", f"Request {i} for the resident adapter.", max_tokens=4)
        assert reply.status_code == 200, reply.text
        generated += reply.json()["usage"]["completion_tokens"]

    a1 = cluster.stats_counting(cluster.worker_a, a0.generated_tokens_total + generated)
    b1 = cluster.stats(cluster.worker_b)
    assert a1.generated_tokens_total - a0.generated_tokens_total == generated
    assert b1.generated_tokens_total == b0.generated_tokens_total and "demo-r16" not in b1.resident_adapters


def test_a_placement_that_would_break_the_tpot_slo_is_avoided(cluster: Cluster) -> None:
    """A holds demo-r16 but runs BUSY long generations; a demo-r16 request goes to A under a loose
    SLO (affinity, batching) and to B under a TPOT SLO that A's predicted TPOT breaks and B's meets."""
    busy, prompt, max_tokens = 8, "Describe a busy worker.", 8
    r64 = cluster.adapter("demo-r64")
    channel = cluster.system.internal_channel(cluster.worker_a)
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    calls = [stub.Generate(worker_pb2.WorkerGenerateRequest(
        request_id=f"busy-{i}", base_model=BASE, adapter=r64, text=f"Keep worker A busy, part {i}.",
        sampling=common_pb2.SamplingParams(max_tokens=1500)), timeout=120) for i in range(busy)]
    try:
        for call in calls:
            next(call)  # every one is running
        loose_b0 = cluster.stats(cluster.worker_b)
        reply = cluster.complete("demo-r16", prompt, max_tokens, LOOSE_SLO)
        assert reply.status_code == 200, reply.text
        assert cluster.stats(cluster.worker_b).generated_tokens_total == loose_b0.generated_tokens_total, \
            "under a loose SLO the request stays with the worker holding its adapter"

        states = {w: worker_state(w, cluster.state(w, until=lambda s: not s.queued and (w == cluster.worker_b or len(
            s.running) >= busy)), None, 0.0) for w in (cluster.worker_a, cluster.worker_b)}
        assert not states[cluster.worker_b].running and "demo-r16" not in states[cluster.worker_b].gpu_adapters
        models = load_perf_models(PERF_MODELS_DIR)
        policy = TesseraPolicy(models, LoadCosts())
        request = routing_request(inference_pb2.GenerateRequest(
            model="demo-r16", text=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens)),
            ResolvedModel(BASE, cluster.adapter("demo-r16")), GatewayConfig())
        tpot = {w: policy.predict(request, s, policy.own_prefill_s(request, s.kind)).tpot_s for w, s in states.items()}
        tpot_a, tpot_b = tpot[cluster.worker_a], tpot[cluster.worker_b]
        assert tpot_a > 1.5 * tpot_b, f"A's batch should make its predicted TPOT clearly worse: {tpot}"
        # Between the two: A's prediction breaks it (A's contexts only grow from here), B's meets it.
        # A is demo-r16's only holder, so A's prediction may use sole_holder_headroom × the SLO.
        slo_ms = math.sqrt(tpot_a / policy.sole_holder_headroom * tpot_b / policy.headroom) * 1e3
        tight_b0 = cluster.stats(cluster.worker_b)
        reply = cluster.complete("demo-r16", prompt, max_tokens, {"tpot_ms": slo_ms, "ttft_ms": 60_000})
        assert reply.status_code == 200, reply.text
        completion = reply.json()["usage"]["completion_tokens"]
        tight_b1 = cluster.stats_counting(cluster.worker_b, tight_b0.generated_tokens_total + completion)
        assert tight_b1.generated_tokens_total - tight_b0.generated_tokens_total == completion
        assert "demo-r16" in tight_b1.resident_adapters
        assert all(c.running() for c in calls), "A was busy the whole time"
    finally:
        for call in calls:
            call.cancel()
        channel.close()


def test_overload_is_429_with_retry_after_and_accepted_requests_complete(cluster: Cluster) -> None:
    fired, prompt, max_tokens = 3 * QUEUE_BOUND + 1, "Say something at length.", 200
    start = threading.Barrier(fired)

    def fire(_: int) -> requests.Response:
        start.wait()
        return cluster.complete(BASE, prompt, max_tokens, LOOSE_SLO)

    with concurrent.futures.ThreadPoolExecutor(fired) as pool:
        replies = list(pool.map(fire, range(fired)))
    accepted = [r for r in replies if r.status_code == 200]
    rejected = [r for r in replies if r.status_code != 200]
    assert len(accepted) >= QUEUE_BOUND and rejected, [r.status_code for r in replies]
    for reply in rejected:
        assert reply.status_code == 429 and int(reply.headers["Retry-After"]) >= 1
        assert reply.json()["error"]["type"] == "overloaded_error"
    # Nothing lost: every accepted request has its whole greedy output, the one it gets alone.
    alone = cluster.complete(BASE, prompt, max_tokens, LOOSE_SLO).json()["choices"][0]
    for reply in accepted:
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == alone["finish_reason"] and choice["text"] == alone["text"]
