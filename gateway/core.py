"""GatewayCore: the one domain object behind both front doors (REST and gRPC).

generate = validate -> resolve `model` (registry cache) -> pick a worker (router) -> stream
from it, tracking in-flight requests and metrics. A worker that fails with UNAVAILABLE
before sending anything is marked down and the request goes to the next one; once tokens
have streamed, a failure ends the request (its tokens cannot be taken back).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from services.config import GatewayConfig
from services.errors import Unavailable
from tessera.v1 import common_pb2, inference_pb2, worker_pb2

from gateway.metrics import GENERATED_TOKENS, IN_FLIGHT, REQUEST_LATENCY, TIME_TO_FIRST_TOKEN
from gateway.registry_cache import RegistryCache, ResolvedModel
from gateway.router import Router
from gateway.schemas import validate_generate_request
from gateway.worker_client import WorkerClient


class GatewayCore:
    def __init__(self, config: GatewayConfig, cache: RegistryCache, router: Router, workers: WorkerClient) -> None:
        self._config = config
        self._cache = cache
        self._router = router
        self._workers = workers

    async def generate(self, request: inference_pb2.GenerateRequest) -> AsyncIterator[common_pb2.GenerateResponse]:
        """Stream token deltas, then exactly one `final` (a FINISH_REASON_ABORT final is an error)."""
        request = validate_generate_request(request, self._config)
        resolved = await self._cache.resolve(request.model)
        worker_request = _worker_request(request, resolved)
        accepted = time.monotonic()
        first_token = True
        IN_FLIGHT.inc()
        try:
            async with contextlib.aclosing(self._forward(resolved.base_model, worker_request)) as responses:
                async for response in responses:
                    kind = response.WhichOneof("payload")
                    if kind == "delta" and first_token:
                        TIME_TO_FIRST_TOKEN.observe(time.monotonic() - accepted)
                        first_token = False
                    if kind == "final":
                        if response.final.finish_reason == common_pb2.FINISH_REASON_ABORT:
                            raise Unavailable(f"the worker aborted request {worker_request.request_id}; retry")
                        GENERATED_TOKENS.inc(response.final.usage.completion_tokens)
                        REQUEST_LATENCY.observe(time.monotonic() - accepted)
                    yield response
        finally:
            IN_FLIGHT.dec()

    async def _forward(self, base_model: str,
                       request: worker_pb2.WorkerGenerateRequest) -> AsyncIterator[common_pb2.GenerateResponse]:
        failed: set[str] = set()
        while True:
            candidates = [w for w in await self._cache.workers_for(base_model) if w.address not in failed]
            address = self._router.pick(base_model, candidates).address
            self._router.started(address)
            streamed = final = False
            try:
                async with contextlib.aclosing(self._workers.generate(address, request)) as responses:
                    async for response in responses:
                        streamed = True
                        final = response.WhichOneof("payload") == "final"
                        yield response
                if final:
                    return
                raise Unavailable(f"worker {address} ended request {request.request_id} without a final message")
            except Unavailable:
                self._router.mark_down(address)
                if streamed:
                    raise
                failed.add(address)
            finally:
                self._router.finished(address)

    async def list_models(self) -> list[inference_pb2.ModelCard]:
        """Every base model and every adapter, in name order."""
        snapshot = await self._cache.snapshot()
        cards = [inference_pb2.ModelCard(id=m.name, base_model=m.name, is_adapter=False,
                                         created_unix=m.created_unix)
                 for m in sorted(snapshot.base_models.values(), key=lambda m: m.name)]
        cards += [inference_pb2.ModelCard(id=a.name, base_model=a.base_model, is_adapter=True, rank=a.rank,
                                          created_unix=a.created_unix)
                  for a in sorted(snapshot.adapters.values(), key=lambda a: a.name)]
        return cards


def _worker_request(request: inference_pb2.GenerateRequest, resolved: ResolvedModel) -> worker_pb2.WorkerGenerateRequest:
    out = worker_pb2.WorkerGenerateRequest(request_id=request.request_id or uuid.uuid4().hex,
                                           base_model=resolved.base_model, sampling=request.sampling)
    if resolved.adapter is not None:
        out.adapter.CopyFrom(resolved.adapter)
    if request.WhichOneof("prompt") == "text":
        out.text = request.text
    else:
        out.chat.CopyFrom(request.chat)
    return out
