"""Fake registry and worker gRPC servers, and a running gateway wired to them.

The fakes are real grpc.aio servers (the generated servicers, port 0) on a background
thread's event loop, which also runs the gateway itself, exactly as its main thread would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import grpc

from gateway.server import Gateway, start_gateway
from services.common.config import TesseraConfig
from services.common.task_heads import TaskHead, task_head_from_record
from tessera.v1 import common_pb2, registry_pb2, registry_pb2_grpc, worker_pb2, worker_pb2_grpc

T = TypeVar("T")

BASE = "tiny-llama"
ADAPTER = "sql-lora"
OTHER_BASE = "tiny-qwen"  # a base model with no worker
PERF_MODEL = "cpu-tessera-demo-llama"  # committed in policy/perf_models
CLASSIFIER = "sentiment-head"  # adapters with task heads, registered by with_head_adapters
DETECTOR = "boxes-head"
HEADS = {
    CLASSIFIER: TaskHead("classifier", ("negative", "neutral", "positive"), (("score.weight", (3, 64)),)),
    DETECTOR: TaskHead("detection", ("cat", "dog"), (("task_head.class_embed.weight", (3, 64)),), positions=4),
}


class LoopThread:
    """An event loop on a daemon thread: the gateway's main loop during a test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 20.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


class FakeRegistry(registry_pb2_grpc.RegistryServicer):
    def __init__(self) -> None:
        self.base_models = [common_pb2.BaseModel(name=BASE, architecture="LlamaForCausalLM", created_unix=100),
                            common_pb2.BaseModel(name=OTHER_BASE, architecture="Qwen2ForCausalLM", created_unix=101)]
        self.adapters = [common_pb2.Adapter(name=ADAPTER, base_model=BASE, rank=8, alpha=16.0, sha256="ab" * 32,
                                            created_unix=200)]
        self.workers: list[common_pb2.WorkerInfo] = []
        self.list_calls = 0

    async def ListBaseModels(self, request, context):
        self.list_calls += 1
        return registry_pb2.ListBaseModelsResponse(base_models=self.base_models)

    async def ListAdapters(self, request, context):
        return registry_pb2.ListAdaptersResponse(adapters=self.adapters)

    async def ListWorkers(self, request, context):
        assert request.healthy_only, "the gateway only wants healthy workers"
        return registry_pb2.ListWorkersResponse(workers=self.workers)

    async def WatchCatalog(self, request, context):
        yield registry_pb2.CatalogChange()
        await asyncio.Event().wait()  # no change is ever announced: tests change the lists and refresh


def fake_logprobs(token_id: int, count: int) -> common_pb2.TokenLogprob:
    """Token i's log-probability -0.25, with the alternatives i, i+1, ... at -0.25, -1.25, ... (best first)."""
    return common_pb2.TokenLogprob(token_id=token_id, token=f"w{token_id} ", logprob=-0.25, top_logprobs=[
        common_pb2.TopLogprob(token_id=token_id + k, token=f"w{token_id + k} ", logprob=-0.25 - k)
        for k in range(count)])


def fake_head_output(request: worker_pb2.WorkerGenerateRequest, words: int) -> common_pb2.HeadOutput:
    """What the adapter's head answers for a prompt of `words` words: a classifier label `words` (mod the
    labels) with probability 1; a detection head `words` boxes, box j [j/10, j/10, 1, 1] of label j (mod)."""
    head = task_head_from_record(request.adapter.task_head_json)
    assert head is not None, "the gateway sends head requests for head adapters only"
    n = len(head.labels)
    if head.kind == "detection":
        return common_pb2.HeadOutput(detections=[
            common_pb2.Detection(label_index=j % n, label=head.labels[j % n], score=1 - j / 10,
                                 box=[j / 10, j / 10, 1.0, 1.0]) for j in range(words)])
    return common_pb2.HeadOutput(probs=[float(i == words % n) for i in range(n)], label_index=words % n,
                                 label=head.labels[words % n])


@dataclasses.dataclass
class FakeWorker(worker_pb2_grpc.WorkerServiceServicer):
    """Streams `max_tokens` deltas "w0 ", "w1 ", ... (token ids 0, 1, ...), then the final;
    each delta carries `fake_logprobs` when the request asks for log-probabilities. A task_head request
    gets only a final holding `fake_head_output`.

    fail_after: abort with UNAVAILABLE after that many deltas (a worker dying mid-stream).
    reject: abort at once with this (code, details), e.g. INVALID_ARGUMENT for a long prompt.
    silent_until: time.monotonic() until which its WatchState streams stay open but push nothing.
    """

    name: str
    delay_s: float = 0.0
    fail_after: int | None = None
    reject: tuple[grpc.StatusCode, str] | None = None
    requests: list[worker_pb2.WorkerGenerateRequest] = dataclasses.field(default_factory=list)
    cancelled: int = 0
    address: str = ""
    base_model: str = BASE
    running: dict[str, worker_pb2.LoadEntry] = dataclasses.field(default_factory=dict)  # request id -> entry
    silent_until: float = 0.0
    kind: str = PERF_MODEL  # a kind the gateway knows by default
    perf_model_spec: str = ""  # its model's JSON, sent in a stream's first state as a real worker does

    async def WatchState(self, request, context) -> AsyncIterator[worker_pb2.WorkerState]:
        """Its running requests, as a real worker reports them."""
        spec = self.perf_model_spec
        while True:
            if (silence_s := self.silent_until - time.monotonic()) > 0:
                await asyncio.sleep(silence_s)
            yield worker_pb2.WorkerState(base_model=self.base_model, perf_model=self.kind, perf_model_spec=spec,
                                         running=list(self.running.values()), max_batch=8, gpu_adapter_slots=4,
                                         free_kv_tokens=100_000)
            spec = ""
            await asyncio.sleep(request.interval_ms / 1e3)

    async def Generate(self, request, context) -> AsyncIterator[common_pb2.GenerateResponse]:
        self.requests.append(request)
        self.running[request.request_id] = worker_pb2.LoadEntry(
            adapter=request.adapter.name, rank=request.adapter.rank, tokens=len(request.text) // 4 + 1)
        try:
            async for response in self._generate(request, context):
                yield response
        finally:
            del self.running[request.request_id]

    async def _generate(self, request, context) -> AsyncIterator[common_pb2.GenerateResponse]:
        if self.reject is not None:
            await context.abort(*self.reject)
        prompt = request.text if request.WhichOneof("prompt") == "text" else request.chat.messages[-1].content
        if request.task_head:
            words = len(prompt.split())
            yield common_pb2.GenerateResponse(request_id=request.request_id, final=common_pb2.Completion(
                finish_reason=common_pb2.FINISH_REASON_STOP, usage=common_pb2.Usage(prompt_tokens=words),
                head=fake_head_output(request, words)))
            return
        texts = []
        wants_logprobs = request.sampling.HasField("logprobs")
        try:
            for i in range(request.sampling.max_tokens):
                if self.fail_after is not None and i == self.fail_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} crashed")
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                texts.append(f"w{i} ")
                logprobs = [fake_logprobs(i, request.sampling.logprobs)] if wants_logprobs else []
                yield common_pb2.GenerateResponse(request_id=request.request_id, delta=common_pb2.TokenDelta(
                    token_ids=[i], text=texts[-1], logprobs=logprobs))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        usage = common_pb2.Usage(prompt_tokens=len(prompt.split()), completion_tokens=len(texts))
        yield common_pb2.GenerateResponse(request_id=request.request_id, final=common_pb2.Completion(
            finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=usage, text="".join(texts)))


async def start_fake_server(servicer: Any, add: Any) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


class GatewayEnv:
    """A fake registry, fake workers serving BASE, and the real gateway in front of them."""

    def __init__(self, *, workers: int = 1, api_keys: list[str] | None = None,
                 refresh_s: float = 60.0, max_queued: int = 256, policy: str = "tessera") -> None:
        self.loop = LoopThread()
        self.registry = FakeRegistry()
        self.registry_server, self.registry_port = self.loop.run(
            start_fake_server(self.registry, registry_pb2_grpc.add_RegistryServicer_to_server))
        self.workers: list[FakeWorker] = []
        self._worker_servers: list[grpc.aio.Server] = []
        for i in range(workers):
            self.add_worker(FakeWorker(name=f"worker{i}"))
        self.config = TesseraConfig()
        self.config.tls.enabled = False  # the fakes serve plaintext; tests/unit/services/test_mutual_tls.py covers TLS
        gw = self.config.gateway
        gw.http_port = gw.grpc_port = gw.metrics_port = 0
        gw.registry_address = f"127.0.0.1:{self.registry_port}"
        gw.metadata_refresh_s = refresh_s
        gw.max_tokens_limit = 64
        gw.default_max_tokens = 5
        gw.http_threads = 4
        gw.api_keys = api_keys or []
        gw.max_queued_per_model = max_queued
        gw.routing_policy = policy
        self.gateway: Gateway = self.loop.run(start_gateway(self.config))

    def add_worker(self, worker: FakeWorker, base_model: str = BASE) -> FakeWorker:
        server, port = self.loop.run(start_fake_server(worker, worker_pb2_grpc.add_WorkerServiceServicer_to_server))
        worker.address = f"127.0.0.1:{port}"
        worker.base_model = base_model
        self.workers.append(worker)
        self._worker_servers.append(server)
        self.registry.workers.append(common_pb2.WorkerInfo(
            worker_id=worker.name, address=worker.address, device="cpu", base_model=base_model,
            capacity=8, healthy=True))
        return worker

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.gateway.grpc_port}"

    def stop_worker(self, index: int) -> None:
        """The worker's process is gone: its streams end and its port refuses; the registry still lists it."""
        self.loop.run(self._worker_servers[index].stop(0))

    def stop_registry(self) -> None:
        self.loop.run(self.registry_server.stop(0))

    def refresh(self) -> bool:
        return self.loop.run(self.gateway.cache.refresh())

    def close(self) -> None:
        self.loop.run(self.gateway.close())
        for server in [self.registry_server, *self._worker_servers]:
            self.loop.run(server.stop(0))
        self.loop.close()


def with_head_adapters(env: GatewayEnv) -> GatewayEnv:
    """`env` with HEADS' adapters on BASE registered (and seen by the gateway)."""
    env.registry.adapters += [common_pb2.Adapter(name=name, base_model=BASE, rank=8, alpha=16.0, sha256="cd" * 32,
                                                 created_unix=300, task_head_json=json.dumps(head.to_json()))
                              for name, head in HEADS.items()]
    assert env.refresh()
    return env
