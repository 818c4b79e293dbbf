"""tessera.v1.WorkerService: a thin translation between the proto contract and the Engine.

The worker assigns every Generate its own request id, which keys it in the engine and which every
response carries; the caller's `request_id` is a label for the logs, so two callers sending the same
one at once get two independent requests.

Only the gateway calls a worker's methods: a caller with another role's cluster certificate gets
PERMISSION_DENIED (services/common/peer_role.py); the gRPC health service answers any of them.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from gpu_worker.delivery import RequestOutput
from gpu_worker.engine import Engine
from gpu_worker.heads import HeadAnswer
from gpu_worker.intake import GenerationRequest
from gpu_worker.prompts import ChatMessage, ImagePart, Prompt
from gpu_worker.registry_client import adapter_ref
from gpu_worker.sequence import MAX_LOGPROBS, FinishReason, SamplingParams
from gpu_worker.state_push import StateSource
from gpu_worker.vision.video import VideoPart
from services.common.errors import InvalidArgument
from services.common.peer_role import require_peer_role
from tessera.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256

_FINISH_REASONS = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}


def _stop_token_ids(ids: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    for i, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidArgument(f"stop_token_ids[{i}] is {token_id}, outside this model's vocabulary "
                                  f"[0, {vocab_size})", param="stop_token_ids")
    return tuple(ids)


def _chat_message(message: common_pb2.ChatMessage, index: int) -> ChatMessage:
    """`content` (text), or `parts` (text, images and videos in order)."""
    if not message.parts:
        return ChatMessage(message.role, message.content)
    if message.content:
        raise InvalidArgument(f"messages[{index}] has both content and parts; send one of them",
                              param=f"messages[{index}]")

    def part(p: common_pb2.ContentPart, j: int) -> str | ImagePart | VideoPart:
        kind = p.WhichOneof("part")
        if kind == "image":
            return ImagePart(p.image)
        if kind != "video":
            return p.text
        if not (p.video.file or p.video.frames.images):
            raise InvalidArgument(f"messages[{index}].parts[{j}].video has no file bytes and no frames",
                                  param=f"messages[{index}].parts[{j}]")
        return VideoPart(p.video.file, tuple(p.video.frames.images), p.video.fps, p.video.max_frames)
    return ChatMessage(message.role, tuple(part(p, j) for j, p in enumerate(message.parts)))


def generation_request(message: worker_pb2.WorkerGenerateRequest, vocab_size: int) -> GenerationRequest:
    """Proto -> domain request under a fresh id of the worker's; proto zero values mean 'default'
    (see common.proto). `vocab_size` bounds the stop token ids: [0, vocab_size) are the model's ids."""
    s = message.sampling
    if message.task_head and message.HasField("sampling"):
        raise InvalidArgument("a task-head request generates no tokens: leave sampling unset", param="sampling")
    if s.temperature < 0 or not 0 <= s.top_p <= 1 or s.top_k < 0 or s.max_tokens < 0:
        raise InvalidArgument("sampling parameters out of range (temperature >= 0, 0 <= top_p <= 1, "
                              "top_k >= 0, max_tokens >= 0)")
    logprobs = s.logprobs if s.HasField("logprobs") else None
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise InvalidArgument(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", param="logprobs")
    params = SamplingParams(temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
                            max_tokens=s.max_tokens or DEFAULT_MAX_TOKENS, stop=tuple(s.stop),
                            stop_token_ids=_stop_token_ids(s.stop_token_ids, vocab_size),
                            seed=s.seed if s.HasField("seed") else None, logprobs=logprobs)
    if not (math.isfinite(message.tpot_slo_ms) and message.tpot_slo_ms >= 0 and math.isfinite(message.ttft_slo_ms)
            and message.ttft_slo_ms >= 0):
        raise InvalidArgument("tpot_slo_ms and ttft_slo_ms must be finite and >= 0 (0: none)", param="slo")
    kind = message.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgument("request has no prompt", param="prompt")
    prompt: Prompt = message.text if kind == "text" else tuple(
        _chat_message(m, i) for i, m in enumerate(message.chat.messages))
    adapter = None
    if message.HasField("adapter"):
        adapter = adapter_ref(message.adapter)
    return GenerationRequest(uuid.uuid4().hex, prompt, params, adapter, message.tpot_slo_ms / 1e3 or None,
                             message.ttft_slo_ms / 1e3 or None, message.task_head)


def _token_logprobs(output: RequestOutput,
                    token_texts: Callable[[list[int]], list[str]]) -> list[common_pb2.TokenLogprob]:
    """RequestOutput.logprobs as protos, with every chosen and top token's text (one tokenizer call)."""
    if not output.logprobs:
        return []
    assert len(output.logprobs) == len(output.token_ids), output
    # dict keeps first-seen order and drops repeats: the chosen token is usually also the top one.
    ids = list(dict.fromkeys(i for token, lp in zip(output.token_ids, output.logprobs)
                             for i in (token, *(alt for alt, _ in lp.top))))
    text = dict(zip(ids, token_texts(ids)))
    return [common_pb2.TokenLogprob(
                token_id=token, token=text[token], logprob=lp.logprob,
                top_logprobs=[common_pb2.TopLogprob(token_id=alt, token=text[alt], logprob=value)
                              for alt, value in lp.top])
            for token, lp in zip(output.token_ids, output.logprobs)]


def _delta(request_id: str, output: RequestOutput,
           token_texts: Callable[[list[int]], list[str]]) -> common_pb2.GenerateResponse:
    return common_pb2.GenerateResponse(request_id=request_id, delta=common_pb2.TokenDelta(
        token_ids=output.token_ids, text=output.text, logprobs=_token_logprobs(output, token_texts)))


def _final(request_id: str, output: RequestOutput) -> common_pb2.GenerateResponse:
    return common_pb2.GenerateResponse(request_id=request_id, final=common_pb2.Completion(
        finish_reason=_FINISH_REASONS[output.finish_reason],
        usage=common_pb2.Usage(prompt_tokens=output.prompt_tokens, completion_tokens=output.completion_tokens),
        text=output.full_text, head=_head_output(output.head) if output.head is not None else None))


def _head_output(answer: HeadAnswer) -> common_pb2.HeadOutput:
    return common_pb2.HeadOutput(
        probs=answer.probs, label_index=answer.label_index, label=answer.label,
        detections=[common_pb2.Detection(label_index=d.label_index, label=d.label, score=d.score, box=d.box)
                    for d in answer.detections])


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, engine: Engine, state: StateSource) -> None:
        self.engine = engine
        self._state = state

    async def Generate(self, request: worker_pb2.WorkerGenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GenerateResponse]:
        require_peer_role(context, "gateway")
        if request.base_model and request.base_model != self.engine.base_model:
            raise InvalidArgument(f"this worker serves {self.engine.base_model}, not {request.base_model}")
        generation = generation_request(request, self.engine.vocab_size)
        handle = await self.engine.submit_async(generation)  # tokenized off this event loop
        if request.request_id:
            log.debug("request %s has the caller's label %r", handle.request_id, request.request_id)
        try:
            async for output in handle:
                # The last output's token ids (and any held-back text) go out as a delta, then the summary.
                if output.finish_reason is None or output.token_ids or output.text:
                    yield _delta(handle.request_id, output, self.engine.token_texts)
                if output.finish_reason is not None:
                    yield _final(handle.request_id, output)
        finally:
            if not handle.finished:  # the client went away (cancelled) before the end
                self.engine.abort(handle.request_id)

    async def GetStats(self, request: worker_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> common_pb2.WorkerStats:
        require_peer_role(context, "gateway")
        return worker_stats(self.engine)

    async def WatchState(self, request: worker_pb2.WatchStateRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.WorkerState]:
        require_peer_role(context, "gateway")
        async for state in self._state.watch(request.interval_ms):
            yield state


def worker_stats(engine: Engine) -> common_pb2.WorkerStats:
    s = engine.stats()
    return common_pb2.WorkerStats(
        running_requests=s.running_requests, waiting_requests=s.waiting_requests,
        running_ranks=list(s.running_ranks), resident_adapters=list(s.resident_adapters),
        free_kv_tokens=s.free_kv_tokens, adapter_slots=s.adapter_slots,
        generated_tokens_total=s.generated_tokens_total, busy_seconds_total=s.busy_seconds_total,
        prefix_cache_hit_tokens_total=s.prefix_cache_hit_tokens_total,
        prefix_cache_query_tokens_total=s.prefix_cache_query_tokens_total,
        prefix_cache_blocks=s.prefix_cache_blocks,
        prefix_cache_evicted_blocks_total=s.prefix_cache_evicted_blocks_total,
        image_cache_hits_total=s.image_cache_hits_total, image_cache_misses_total=s.image_cache_misses_total,
        image_cache_evictions_total=s.image_cache_evictions_total, image_cache_entries=s.image_cache_entries,
        image_cache_bytes=s.image_cache_bytes, image_cache_capacity_bytes=s.image_cache_capacity_bytes,
        adapter_gpu_bytes=s.adapters.gpu_capacity_bytes, adapter_host_bytes=s.adapters.host_capacity_bytes,
        adapter_requests_total=[common_pb2.AdapterRequests(adapter=name, requests=count)
                                for name, count in sorted(s.adapter_requests_total.items())])
