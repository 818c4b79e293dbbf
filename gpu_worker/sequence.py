"""A request's life inside the engine: its tokens, adapter slot, KV progress and output text."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass

import torch

from gpu_worker.detokenizer import IncrementalDetokenizer
from gpu_worker.lora.host_weights import PackedAdapter
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.vision.images import PromptImages
from kernels import NO_SLOT
from services.common.task_heads import TaskHead


MAX_LOGPROBS = 20  # as OpenAI's top_logprobs
IN_FLIGHT_ID = 0   # host placeholder for a token id that is still on the device


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0    # 0: greedy
    top_p: float = 1.0
    top_k: int = 0              # 0: disabled
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # finish (STOP) after sampling one of these; the token is kept
    seed: int | None = None
    logprobs: int | None = None  # None: none; n >= 0: the chosen token's and the n most likely ones

    def __post_init__(self) -> None:
        assert self.temperature >= 0 and 0 < self.top_p <= 1 and self.top_k >= 0 and self.max_tokens > 0, self
        assert self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, self
        assert all(t >= 0 for t in self.stop_token_ids), self


class FinishReason(enum.Enum):
    STOP = "stop"       # EOS, a stop string or a stop token id
    LENGTH = "length"   # max_tokens
    ABORT = "abort"     # the client went away, or the engine failed the request


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # not admitted yet, or preempted (its KV blocks were freed)
    RUNNING = "running"      # holds KV blocks and an adapter slot
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 adapter: AdapterRef | None, detokenizer: IncrementalDetokenizer,
                 images: PromptImages | None = None, head: TaskHead | None = None) -> None:
        """`head`: answer with the adapter's task head after one pass over the prompt, generating nothing."""
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.images = images
        # [images.num_tokens, hidden] on the model's device: made by the first prefill chunk that
        # reaches an image token, dropped once every image token is cached (remade after preemption).
        self.image_features: torch.Tensor | None = None
        self.output_token_ids: list[int] = []
        self.head = head
        # A head request's hidden states at the head's positions, [positions, hidden] in all, gathered from the
        # prefill chunks that run them (dropped by preemption with the K/V they came with).
        self.head_hidden: list[torch.Tensor] = []
        # Tokens sampled by launched steps that have not reached the host yet (async scheduling: a
        # decode step may run while the previous one's token is still on the device). They count in
        # num_tokens, so the next step schedules and grows blocks for them.
        self.num_in_flight = 0
        self._decoded = 0                   # leading output tokens the detokenizer has seen
        self.params = params
        self.adapter = adapter
        self.detokenizer = detokenizer
        self.status = SequenceStatus.WAITING
        self.slot = NO_SLOT
        self.rank = 0
        # While its adapter is not usable on the GPU: the host copy the CPU LoRA workers compute its
        # LoRA deltas from (lora/cpu_assist.py); slot stays NO_SLOT for the GPU kernels.
        self.cpu_adapter: PackedAdapter | None = None
        self.cold = False  # its adapter was not usable when it was first considered, and it is not admitted yet
        self.tpot_slo_s: float | None = None  # its TPOT objective (the gateway's routing), if any
        self.ttft_slo_s: float | None = None  # its TTFT objective, likewise
        self.last_token_s = time.perf_counter()  # when its last token was sampled, or it arrived
        self.num_cached = 0                 # leading tokens whose K/V are in the cache
        self.block_table: list[int] = []    # KV-cache blocks holding those tokens, in order
        # Prefix caching (block_manager.py): content hashes of the leading full blocks computed so far
        # (they depend on tokens and images only, so they stay valid across preemption), how many of
        # block_table's blocks were offered to the cache, and whether its K/V may be shared at all
        # (not once a step ran on merged weights: their K/V is not bit-identical to unmerged LoRA's).
        self.block_hashes: list[bytes] = []
        self.num_published_blocks = 0
        self.kv_shareable = True
        self.finish_reason: FinishReason | None = None
        self.generator: torch.Generator | None = None  # created by the sampler for sampled requests

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_in_flight

    @property
    def sampled_all(self) -> bool:
        """Every token this request will produce is sampled, the last perhaps still in flight: its
        finish is known, or it has max_tokens tokens counting those in flight; a head request, once its
        whole prompt ran (its answer perhaps still in flight)."""
        if self.head is not None:
            return self.finish_reason is not None or self.num_cached >= self.prompt_len
        return self.finish_reason is not None or \
            len(self.output_token_ids) + self.num_in_flight >= self.params.max_tokens

    @property
    def tail_to_run(self) -> int:
        """The prompt's last tokens that prefill must run even when the prefix cache holds them: the one
        whose logits sample the first token, or a task head's positions (it reads their hidden states)."""
        return self.head.positions if self.head is not None else 1

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_cached

    def pending_token_ids(self, count: int) -> list[int]:
        """The next `count` tokens to run: a prompt chunk (or, after preemption, the recomputed
        prompt and outputs), or the last sampled token when decoding. A token still in flight reads
        as IN_FLIGHT_ID: the model runner takes it from the device."""
        known = self.token_ids_in(self.num_cached, self.num_cached + count)
        return known + [IN_FLIGHT_ID] * (count - len(known))

    def token_ids_in(self, start: int, end: int) -> list[int]:
        """Positions [start, end) of the prompt followed by the outputs."""
        if start >= self.prompt_len:
            return self.output_token_ids[start - self.prompt_len:end - self.prompt_len]
        tokens = self.prompt_token_ids[start:end]
        return tokens + self.output_token_ids[:end - start - len(tokens)]

    def rope_positions(self, start: int, end: int) -> list[int] | list[list[int]]:
        """Rotary positions of tokens [start, end): [end - start], or [3][end - start] for a chunk over
        an M-RoPE prompt's images (Qwen2-VL; its outputs continue from the prompt's largest position)."""
        mrope = self.images.positions if self.images is not None else None
        return list(range(start, end)) if mrope is None else mrope.positions_in(start, end)

    def append(self, token_id: int, eos_token_id: int | None) -> None:
        """Add a sampled token and decide whether the request finishes. Its text waits for
        `decode_text` unless stop strings need it now: the engine decodes while the device runs the
        next step."""
        self.output_token_ids.append(token_id)
        self.last_token_s = time.perf_counter()
        if self.params.stop:
            self.decode_text()
        if token_id == eos_token_id or token_id in self.params.stop_token_ids or self.detokenizer.stopped:
            self.finish_reason = FinishReason.STOP
        elif len(self.output_token_ids) >= self.params.max_tokens:
            self.finish_reason = FinishReason.LENGTH

    def decode_text(self) -> None:
        """Feed the detokenizer the output tokens it has not seen yet."""
        for token_id in self.output_token_ids[self._decoded:]:
            self.detokenizer.append(token_id)
        self._decoded = len(self.output_token_ids)
