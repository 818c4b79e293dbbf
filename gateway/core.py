"""GatewayCore: the one domain object behind both front doors (REST and gRPC).

generate = validate -> resolve `model` (registry cache) -> admit (a bounded number in flight per
base model) -> pick a worker (router, over the workers' pushed state) -> stream from it, tracking
in-flight requests and metrics. A worker that fails with UNAVAILABLE before sending anything is
marked down and the request goes to the next one; once tokens have streamed, a failure ends the
request (its tokens cannot be taken back).

classify = validate -> resolve an adapter with a task head -> each input as its own worker request
(task_head), all at once, each admitted, routed and retried as a generation is -> the heads' answers
in input order. The first failure fails the request and cancels the other inputs.

Request ids are the gateway's: every request gets a fresh one, which keys it in the router and on
the worker and which every response carries. A client's `request_id` is only a label, logged beside
that id: two clients may send the same label at once without touching each other's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from services.common.config import GatewayConfig
from services.common.errors import Internal, Unavailable
from tessera.v1 import common_pb2, inference_pb2, worker_pb2

from gateway.admission import Admission
from gateway.classify import refuse_task_head, require_task_head, validate_classify_request
from gateway.images import check_takes_images
from gateway.metrics import GENERATED_TOKENS, IN_FLIGHT, REQUEST_LATENCY, TIME_TO_FIRST_TOKEN
from gateway.registry_cache import TASK_PREFIX, RegistryCache, ResolvedModel
from gateway.router import Router
from policy.routing.policies import RoutingRequest, Slo
from gateway.schemas import chat_text_chars, validate_generate_request
from gateway.state_feed import StateFeed
from gateway.worker_client import WorkerClient

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # the gateway does not tokenize; a BPE token is ~4 characters of English

T = TypeVar("T")


class GatewayCore:
    def __init__(self, config: GatewayConfig, cache: RegistryCache, admission: Admission, router: Router,
                 feed: StateFeed, workers: WorkerClient) -> None:
        self._config = config
        self._cache = cache
        self._admission = admission
        self._router = router
        self._feed = feed
        self._workers = workers

    async def generate(self, request: inference_pb2.GenerateRequest) -> AsyncIterator[common_pb2.GenerateResponse]:
        """Stream token deltas, then exactly one `final` (a FINISH_REASON_ABORT final is an error)."""
        with _logging_unavailable(request.model):
            async with contextlib.aclosing(self._generate(request)) as responses:
                async for response in responses:
                    yield response

    async def _generate(self, request: inference_pb2.GenerateRequest) -> AsyncIterator[common_pb2.GenerateResponse]:
        request = validate_generate_request(request, self._config)
        resolved = await self._cache.resolve(request.model)
        refuse_task_head(resolved)
        check_takes_images(request, resolved)
        routing = routing_request(request, resolved, self._config)
        worker_request = _worker_request(request, resolved, routing.slo, uuid.uuid4().hex)
        _log_label(worker_request.request_id, request.request_id)
        async with contextlib.aclosing(self._dispatch(resolved.base_model, routing, worker_request)) as responses:
            async for response in responses:
                yield response

    async def classify(self, request: inference_pb2.ClassifyRequest) -> inference_pb2.ClassifyResponse:
        """Each input answered by the adapter's task head, in order; usage: every input's prompt tokens."""
        with _logging_unavailable(request.model):
            prompts = validate_classify_request(request, self._config)
            resolved = await self._cache.resolve(request.model)
            require_task_head(request.model, resolved)
            for prompt in prompts:
                check_takes_images(prompt, resolved)
            request_id = uuid.uuid4().hex
            _log_label(request_id, request.request_id)
            # One id per input ("<id>-2"): the router and the worker key requests by it.
            finals = await _all_or_none([self._head_answer(prompt, resolved, f"{request_id}-{i}")
                                         for i, prompt in enumerate(prompts)])
            return inference_pb2.ClassifyResponse(
                request_id=request_id, results=[final.head for final in finals],
                usage=common_pb2.Usage(prompt_tokens=sum(final.usage.prompt_tokens for final in finals)))

    async def _head_answer(self, prompt: inference_pb2.GenerateRequest, resolved: ResolvedModel,
                           request_id: str) -> common_pb2.Completion:
        routing = routing_request(prompt, resolved, self._config)
        worker_request = _worker_request(prompt, resolved, routing.slo, request_id, task_head=True)
        final = None
        async with contextlib.aclosing(self._dispatch(resolved.base_model, routing, worker_request)) as responses:
            async for response in responses:
                final = response.final  # a head request streams its final only
        if final is None or not final.HasField("head"):
            raise Internal(f"the worker answered head request {request_id} without a head output")
        return final

    async def _dispatch(self, base_model: str, routing: RoutingRequest, worker_request: worker_pb2.WorkerGenerateRequest
                        ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """A worker's answer to `worker_request`, admitted and timed; its responses carry the gateway's id."""
        with self._admission.admit(base_model), IN_FLIGHT.track_inprogress():
            accepted = time.monotonic()
            first_token = True
            async with contextlib.aclosing(self._forward(base_model, routing, worker_request)) as responses:
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
                    response.request_id = worker_request.request_id  # the worker answers with its own id
                    yield response

    async def _forward(self, base_model: str, routing: RoutingRequest,
                       request: worker_pb2.WorkerGenerateRequest) -> AsyncIterator[common_pb2.GenerateResponse]:
        failed: set[str] = set()
        while True:
            address = (await self._pick(base_model, routing, failed)).address
            self._router.started(address, request.request_id, routing.slo.tpot_s)
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
                self._router.finished(address, request.request_id)

    async def _pick(self, base_model: str, routing: RoutingRequest, failed: set[str]) -> common_pb2.WorkerInfo:
        """A worker for the request, among the registry's healthy ones not in `failed`. While none has a
        fresh state but one's state stream is open and silent (`StateFeed.late`: the worker paused, or this
        gateway's loop behind a burst), wait for its next state — as long as the registry lists it (its
        heartbeat timeout) and at most `late_worker_wait_s` — instead of refusing a live worker. A worker
        whose stream ended (it died) is not waited for: that request's 503 comes at once."""
        stale_s = self._config.state_stale_s
        give_up_at = time.monotonic() + self._config.late_worker_wait_s
        while True:
            candidates = [w for w in await self._cache.workers_for(base_model) if w.address not in failed]
            addresses = [w.address for w in candidates]
            self._feed.watch(addresses)
            await self._feed.settled(addresses, stale_s, stale_s)
            try:
                return self._router.pick(routing, base_model, candidates)
            except Unavailable:
                late = self._feed.late(addresses, stale_s)
                if not late or time.monotonic() >= give_up_at:
                    raise
                log.debug("no worker for %r has a fresh state; waiting for %s", base_model, ", ".join(late))

    async def list_models(self) -> list[inference_pb2.ModelCard]:
        """Every base model, every adapter, then every task as "task:<name>" (its parent: the adapter serving
        it), each in name order."""
        snapshot = await self._cache.snapshot()
        cards = [inference_pb2.ModelCard(id=m.name, base_model=m.name, is_adapter=False,
                                         created_unix=m.created_unix)
                 for m in sorted(snapshot.base_models.values(), key=lambda m: m.name)]
        cards += [inference_pb2.ModelCard(id=a.name, base_model=a.base_model, is_adapter=True, rank=a.rank,
                                          created_unix=a.created_unix, parent=a.base_model)
                  for a in sorted(snapshot.adapters.values(), key=lambda a: a.name)]
        cards += [inference_pb2.ModelCard(id=TASK_PREFIX + task, base_model=a.base_model, is_adapter=True, rank=a.rank,
                                          created_unix=a.created_unix, parent=a.name)
                  for task, a in sorted(snapshot.tasks.items())]
        return cards


def routing_request(request: inference_pb2.GenerateRequest, resolved: ResolvedModel,
                     config: GatewayConfig) -> RoutingRequest:
    """What the policy prices: the adapter, an estimate of the prompt's tokens, max_tokens as the
    expected output (an upper bound: what the request may hold a batch seat for) and the SLO: each
    objective the request's, else its adapter's default (the registry's), else the gateway's."""
    adapter = resolved.adapter
    chars = len(request.text) if request.WhichOneof("prompt") == "text" else (
        chat_text_chars(request.chat) + sum(len(m.role) for m in request.chat.messages))
    adapter_slo = (adapter.tpot_slo_ms, adapter.ttft_slo_ms) if adapter else (0.0, 0.0)
    slo = Slo(tpot_s=(request.slo.tpot_ms or adapter_slo[0] or config.default_tpot_slo_ms) / 1e3,
              ttft_s=(request.slo.ttft_ms or adapter_slo[1] or config.default_ttft_slo_ms) / 1e3)
    return RoutingRequest(adapter.name if adapter else "", adapter.rank if adapter else 0,
                          chars // CHARS_PER_TOKEN + 1, request.sampling.max_tokens, slo)


def _worker_request(request: inference_pb2.GenerateRequest, resolved: ResolvedModel, slo: Slo, request_id: str,
                    task_head: bool = False) -> worker_pb2.WorkerGenerateRequest:
    """`task_head`: answered by the adapter's head after one pass, so with no sampling (the worker's contract)."""
    out = worker_pb2.WorkerGenerateRequest(request_id=request_id, base_model=resolved.base_model,
                                           sampling=None if task_head else request.sampling,
                                           tpot_slo_ms=slo.tpot_s * 1e3, ttft_slo_ms=slo.ttft_s * 1e3,
                                           task_head=task_head)
    if resolved.adapter is not None:
        out.adapter.CopyFrom(resolved.adapter)
    if request.WhichOneof("prompt") == "text":
        out.text = request.text
    else:
        out.chat.CopyFrom(request.chat)
    return out


def _log_label(request_id: str, label: str) -> None:
    if label:
        log.debug("request %s has the client's label %r", request_id, label)


@contextlib.contextmanager
def _logging_unavailable(model: str) -> Iterator[None]:
    """Every UNAVAILABLE (503) is logged with its reason: a client's 503 always has a line to match."""
    try:
        yield
    except Unavailable as exc:
        log.warning("unavailable (503) for model %r: %s", model, exc.message)
        raise


async def _all_or_none(calls: list[Coroutine[Any, Any, T]]) -> list[T]:
    """The calls' results in order, run at once. The first failure cancels the others and is raised once they
    have ended (asyncio.gather alone would leave them running, holding their admission places)."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
