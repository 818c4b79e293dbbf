"""A request's way in: validated and tokenized on the calling thread (the engine's intake threads for
the servicer: Engine.submit_async), so bad input fails in the caller, then handed to the engine
thread as a Sequence with the RequestHandle that streams its outputs.

Request ids are unique among the requests in flight: an id is claimed at `accept` and free again
once the engine closes the request (`release`, from the engine thread), before its last output is
delivered. The servicer gives every request a fresh id; in-process callers choose theirs.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase, ProcessorMixin

from gpu_worker.delivery import RequestHandle
from gpu_worker.detokenizer import IncrementalDetokenizer
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.prompts import Prompt, PromptEncoder
from gpu_worker.sequence import SamplingParams, Sequence
from services.common.errors import AlreadyExists, InvalidArgument
from services.common.task_heads import TaskHead


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: Prompt  # text, or chat messages (whose content may hold images: prompts.ImagePart)
    params: SamplingParams
    adapter: AdapterRef | None = None
    tpot_slo_s: float | None = None  # its time-per-output-token objective, if the caller gave one
    ttft_slo_s: float | None = None  # its time-to-first-token objective, likewise
    task_head: bool = False  # answer with the adapter's task head after one pass (params unused), generating nothing


class Intake:
    """Turns requests into sequences for one worker: its base model, ranks and KV-cache capacity."""

    def __init__(self, *, base_model: str, tokenizer: PreTrainedTokenizerBase, processor: ProcessorMixin | None,
                 max_context: int, max_lora_rank: int, kv_capacity_tokens: int) -> None:
        self._base_model = base_model
        self._tokenizer = tokenizer
        self._prompts = PromptEncoder(tokenizer, max_context, processor)
        self._max_lora_rank = max_lora_rank
        self._kv_capacity_tokens = kv_capacity_tokens
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()  # request ids accepted and not released (any thread)

    def accept(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> tuple[Sequence, RequestHandle]:
        """Validate and tokenize `request` and claim its id; -> its sequence and the handle streaming
        its outputs on `loop`. Raises InvalidArgument or AlreadyExists."""
        if request.adapter is not None and request.adapter.base_model != self._base_model:
            raise InvalidArgument(f"adapter {request.adapter.name} is for base model "
                                  f"{request.adapter.base_model}, this worker serves {self._base_model}")
        if request.adapter is not None and request.adapter.rank > self._max_lora_rank:
            raise InvalidArgument(f"adapter {request.adapter.name} has rank {request.adapter.rank}; this worker "
                                  f"serves ranks up to {self._max_lora_rank} (max_lora_rank)")
        head = _task_head(request)
        max_tokens = 1 if head is not None else request.params.max_tokens
        prompt = self._prompts.encode(request.prompt, max_tokens)
        ids = prompt.token_ids
        if head is not None and len(ids) < head.positions:
            raise InvalidArgument(f"adapter {request.adapter.name}'s head reads the prompt's last {head.positions} "
                                  f"tokens; the prompt has {len(ids)}", param="input")
        needed = len(ids) + max_tokens - 1
        if needed > self._kv_capacity_tokens:
            raise InvalidArgument(f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) needs "
                                  f"{needed} KV-cache tokens; this worker holds {self._kv_capacity_tokens}")
        with self._lock:
            if request.request_id in self._in_flight:
                raise AlreadyExists(f"request {request.request_id} is already running")
            self._in_flight.add(request.request_id)
        detok = IncrementalDetokenizer(self._tokenizer, ids, request.params.stop)
        seq = Sequence(request.request_id, ids, request.params, request.adapter, detok, prompt.images, head)
        seq.tpot_slo_s, seq.ttft_slo_s = request.tpot_slo_s, request.ttft_slo_s
        return seq, RequestHandle(request.request_id, loop)

    def release(self, request_id: str) -> None:
        """The request is closed: its id may be used again."""
        with self._lock:
            self._in_flight.discard(request_id)

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows (added tokens included): valid ids are [0, vocab_size)."""
        return len(self._tokenizer)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each id decoded alone, special tokens kept ("</s>"): the `token` of log-probability entries."""
        return self._tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                            clean_up_tokenization_spaces=False)


def _task_head(request: GenerationRequest) -> TaskHead | None:
    """The head that answers `request`, None for generation; InvalidArgument when the adapter does not fit
    the ask (a head request needs an adapter with a head, and a head adapter answers only head requests)."""
    head = request.adapter.head if request.adapter is not None else None
    if request.task_head and head is None:
        what = f"adapter {request.adapter.name}" if request.adapter is not None else "the base model"
        raise InvalidArgument(f"{what} has no task head; a head request needs an adapter with one "
                              "(docs/task-heads.md)", param="model")
    if head is not None and not request.task_head:
        raise InvalidArgument(f"adapter {request.adapter.name} has a task head ({head.kind}) and answers "
                              "classification only: ask POST /v1/classify (gRPC Classify)", param="model")
    return head
