"""The serving engine: a thread that loops schedule → run → sample → postprocess.

Callers on the asyncio side `submit` a request (tokenized and validated at once, so bad input
fails in the caller) and get a RequestHandle; the engine thread pushes each step's outputs into
the handles' asyncio queues, one `loop.call_soon_threadsafe` per event loop and step. `abort`
retires a request whose client went away. All scheduler state is touched by the engine thread
only; other threads talk to it through the inbox.

A step's host work is split around the device. What the next schedule needs (token ids, whether
each request finished, freeing finished requests' blocks) runs as soon as the tokens arrive; the
rest (detokenizing, streaming outputs, stats) waits until the next step is on the device and runs
while the device works (`_send_outputs`). On an H200 the loop then added 0.03-0.27 ms to a decode
step at batch 1-32, against 0.12-1.28 ms before (benchmarks/engine_loop_bench.py). Pending outputs are always sent before the inbox is
applied and before the engine idles, so aborts and shutdown see every request as before.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase, ProcessorMixin

from gpu_worker.detokenizer import IncrementalDetokenizer
from gpu_worker.block_manager import BlockManager
from gpu_worker.lora.adapter_pool import AdapterPool
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.model_runner import ModelRunner
from gpu_worker.prompts import Prompt, PromptEncoder
from gpu_worker.sampler import SampledTokens, TokenLogprobs, sample
from gpu_worker.scheduler import ScheduledBatch, Scheduler
from gpu_worker.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from gpu_worker.vision.image_cache import ImageFeatureCache
from services.common.errors import AlreadyExists, Internal, InvalidArgument, TesseraError

log = logging.getLogger(__name__)

_NO_IMAGE_CACHE = ImageFeatureCache(0)  # a text model's image-cache stats: all zeros


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: Prompt  # text, or chat messages (whose content may hold images: prompts.ImagePart)
    params: SamplingParams
    adapter: AdapterRef | None = None


@dataclass(frozen=True)
class RequestOutput:
    """One streamed increment; the last one has `finish_reason` set and the whole text."""
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    full_text: str = ""
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id, when the request asked for them


@dataclass(frozen=True)
class StepRecord:
    """What one forward pass did (metrics, and tests checking batch composition)."""
    step: int
    request_ids: tuple[str, ...]
    adapters: tuple[str | None, ...]
    num_prefills: int      # sequences that ran prompt tokens (a whole prompt or a chunk)
    num_tokens: int
    num_preempted: int     # sequences preempted to make room in this step
    duration_s: float      # launch to tokens on the host (async scheduling launches the next step in between)
    merged_adapter: str | None = None  # the adapter folded into the base weights for this step


@dataclass(frozen=True)
class SeqLoad:
    """A sequence as the gateway's performance model prices it."""
    adapter: str | None
    rank: int
    tokens: int  # running: context so far; waiting: tokens to (re)compute before its first decode


@dataclass(frozen=True)
class EngineStats:
    running_requests: int
    waiting_requests: int
    running_ranks: tuple[int, ...]
    resident_adapters: tuple[str, ...]
    free_kv_tokens: int
    preemptions_total: int
    adapter_slots: int
    pinned_adapters: int    # adapter pins held by running sequences
    generated_tokens_total: int
    prefix_cache_hit_tokens_total: int = 0  # prompt tokens whose K/V came from the prefix cache
    prefix_cache_query_tokens_total: int = 0  # tokens of sequences admitted with prefix caching on
    prefix_cache_blocks: int = 0            # KV blocks whose content is published (in use or evictable)
    prefix_cache_evicted_blocks_total: int = 0
    image_cache_hits_total: int = 0         # images whose features came from the image-embedding cache
    image_cache_misses_total: int = 0       # images that went through the vision encoder
    image_cache_evictions_total: int = 0
    image_cache_entries: int = 0
    image_cache_bytes: int = 0
    image_cache_capacity_bytes: int = 0     # image_cache_bytes of the config; 0 for a text model
    running_load: tuple[SeqLoad, ...] = ()
    waiting_load: tuple[SeqLoad, ...] = ()


@dataclass(frozen=True)
class _LaunchedStep:
    batch: ScheduledBatch
    sampled: SampledTokens
    started: float
    merged_adapter: str | None  # folded into the base weights for this step


class RequestHandle:
    """Async iterator over a request's outputs; raises the engine's error if the request failed."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | TesseraError] = asyncio.Queue()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, TesseraError):
                self.finished = True
                raise item
            self.finished = item.finish_reason is not None
            yield item


def _deliver(items: list[tuple[RequestHandle, RequestOutput | TesseraError]]) -> None:
    """Put each item into its handle's queue, from the engine thread: one wake-up of each event
    loop for all of its handles' items, in order."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | TesseraError]]] = {}
    for handle, item in items:
        by_loop.setdefault(handle._loop, []).append((handle._queue, item))
    for loop, puts in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, puts)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening any more


def _put_all(puts: list[tuple[asyncio.Queue, RequestOutput | TesseraError]]) -> None:
    for queue_, item in puts:
        queue_.put_nowait(item)


class Engine:
    def __init__(self, *, base_model: str, runner: ModelRunner, scheduler: Scheduler,
                 adapters: AdapterPool, tokenizer: PreTrainedTokenizerBase, max_context: int, max_lora_rank: int,
                 async_scheduling: bool, on_step: Callable[[StepRecord], None] | None = None,
                 processor: ProcessorMixin | None = None) -> None:
        self.base_model = base_model
        self._runner = runner
        self._scheduler = scheduler
        self._blocks: BlockManager = scheduler.blocks
        self._max_lora_rank = max_lora_rank
        self._adapters = adapters
        self._tokenizer = tokenizer
        self.max_context = max_context
        self._prompts = PromptEncoder(tokenizer, max_context, processor)
        self._on_step = on_step
        self._eos = tokenizer.eos_token_id
        self._inbox: queue.SimpleQueue[tuple[str, object] | None] = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}  # request id -> handle, engine thread only
        self._seqs: dict[str, Sequence] = {}
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()  # request ids submitted and not finished (any thread)
        self._step = 0
        self._generated_total = 0
        # Sampled tokens whose outputs are not sent yet (`_send_outputs`): (sequence, token, log-probabilities).
        self._unsent: list[tuple[Sequence, int, TokenLogprobs | None]] = []
        self._async_scheduling = async_scheduling
        self._launched: _LaunchedStep | None = None  # the step on the device whose tokens are not taken yet
        self._stats = self._snapshot()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # --- caller side (any thread) ---

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join()

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> RequestHandle:
        if request.adapter is not None and request.adapter.base_model != self.base_model:
            raise InvalidArgument(f"adapter {request.adapter.name} is for base model "
                                  f"{request.adapter.base_model}, this worker serves {self.base_model}")
        if request.adapter is not None and request.adapter.rank > self._max_lora_rank:
            raise InvalidArgument(f"adapter {request.adapter.name} has rank {request.adapter.rank}; this worker "
                                  f"serves ranks up to {self._max_lora_rank} (max_lora_rank)")
        prompt = self._prompts.encode(request.prompt, request.params.max_tokens)
        ids = prompt.token_ids
        needed = len(ids) + request.params.max_tokens - 1
        if needed > self._blocks.capacity_tokens:
            raise InvalidArgument(f"prompt ({len(ids)} tokens) plus max_tokens ({request.params.max_tokens}) needs "
                                  f"{needed} KV-cache tokens; this worker holds {self._blocks.capacity_tokens}")
        with self._lock:
            if request.request_id in self._in_flight:
                raise AlreadyExists(f"request {request.request_id} is already running")
            self._in_flight.add(request.request_id)
        detok = IncrementalDetokenizer(self._tokenizer, ids, request.params.stop)
        seq = Sequence(request.request_id, ids, request.params, request.adapter, detok, prompt.images)
        handle = RequestHandle(request.request_id, loop)
        self._inbox.put(("add", (seq, handle)))
        return handle

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows (added tokens included): valid ids are [0, vocab_size)."""
        return len(self._tokenizer)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each id decoded alone, special tokens kept ("</s>"): the `token` of log-probability entries."""
        return self._tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                            clean_up_tokenization_spaces=False)

    # --- engine thread ---

    def _loop(self) -> None:
        while True:
            idle = self._launched is None and not self._scheduler.has_work()
            if idle:
                self._send_outputs()
            if not self._drain_inbox(block=idle):
                return
            if self._launched is not None or self._scheduler.has_work():
                try:
                    self.step()
                except Exception:
                    log.exception("engine step failed; failing its requests")
                    self._fail_step()

    def _fail_step(self) -> None:
        """After a failed step: fail every running request, and every preempted one whose token was in
        flight (that token is lost); the others wait on."""
        self._launched = None
        self._send_outputs()  # tokens sampled before the failure still reach their clients
        lost = [seq for seq in self._scheduler.waiting if seq.num_in_flight]
        for seq in list(self._scheduler.running) + lost:
            if self._seqs.get(seq.request_id) is seq:
                self._fail(seq, Internal("the engine failed while running this request"))
            else:  # its final output is sent; only a step in flight still held it
                self._scheduler.finish(seq, seq.finish_reason)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued submits/aborts; False when asked to stop."""
        try:
            message = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            if message is None or message[0] != "add":
                self._settle()  # aborts and shutdown find every request as its last step left it
            if message is None:
                for seq in list(self._seqs.values()):
                    self._abort(seq)
                return False
            kind, payload = message
            if kind == "add":
                seq, handle = payload
                self._seqs[seq.request_id], self._handles[seq.request_id] = seq, handle
                self._scheduler.add(seq)
            elif payload in self._seqs:
                self._abort(self._seqs[payload])
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                self._publish_stats()
                return True

    def _settle(self) -> None:
        """Finish the step in flight, if any, and send every pending output."""
        if self._launched is not None:
            launched, self._launched = self._launched, None
            self._complete(launched)
        self._send_outputs()

    def step(self) -> None:
        """Schedule and launch a step. With async scheduling, the step before is still on the device:
        its tokens are taken after this one is launched (the new step reads them on the device), and
        this step stays in flight until the next call."""
        previous, self._launched = self._launched, None
        batch = self._scheduler.schedule()
        for seq, error in batch.failed:
            self._fail(seq, error)
        if not batch.items:
            if previous is not None:  # its requests may have sampled their last tokens
                self._complete(previous)
            self._send_outputs()
            if previous is None:
                self._publish_stats()
                time.sleep(0.001)  # everything waits for an adapter slot; let aborts arrive
            return
        launched = self._launch(batch, previous)
        if previous is not None:
            self._complete(previous)
        self._publish_blocks(batch)  # after the step before's tokens: its block hashes may cover them
        self._send_outputs()  # the step before's outputs, while the device runs this one
        if self._async_scheduling:
            self._launched = launched
        else:
            self._complete(launched)

    def _launch(self, batch: ScheduledBatch, previous: _LaunchedStep | None) -> _LaunchedStep:
        """Run `batch` and sample on the device; the tokens reach the host in `_complete`."""
        started = time.perf_counter()
        sampling, logits = self._runner.run(batch.items, previous.sampled if previous is not None else None)
        for seq in sampling:
            seq.num_in_flight += 1
        return _LaunchedStep(batch, sample(logits, sampling), started, self._runner.merged_adapter)

    def _publish_blocks(self, batch: ScheduledBatch) -> None:
        for item in batch.items:
            self._blocks.publish(item.seq)  # before retiring: a finished prompt's blocks stay reusable

    def _complete(self, launched: _LaunchedStep) -> None:
        """Take a step's tokens: append them, decide which requests finished and free those that no
        launched step still runs. Streaming waits for `_send_outputs`."""
        tokens, logprobs = launched.sampled.result()
        for seq, token, token_logprobs in zip(launched.sampled.seqs, tokens, logprobs):
            seq.num_in_flight -= 1
            if seq.finish_reason is not None:  # it finished a step earlier; this token ran ahead of that
                self._release(seq)
                continue
            seq.append(token, self._eos)
            self._generated_total += 1
            if seq.finish_reason is not None:
                self._release(seq)  # its blocks serve the next step already
            self._unsent.append((seq, token, token_logprobs))
        self._step += 1
        if self._on_step is not None:
            batch, seqs = launched.batch, [item.seq for item in launched.batch.items]
            self._on_step(StepRecord(
                self._step, tuple(s.request_id for s in seqs), tuple(s.adapter.name if s.adapter else None for s in seqs),
                sum(1 for item in batch.items if item.num_new > 1 or not item.samples), batch.num_tokens,
                len(batch.preempted), time.perf_counter() - launched.started, launched.merged_adapter))

    def _release(self, seq: Sequence) -> None:
        """Free a finished request's blocks and adapter pin, unless a launched step still runs it
        (its last token there is dropped, and that step's completion frees it)."""
        if seq.num_in_flight == 0 and seq.status is not SequenceStatus.FINISHED:
            self._scheduler.finish(seq, seq.finish_reason)

    def _send_outputs(self) -> None:
        """Detokenize the unsent tokens and stream them; close the requests they finished."""
        unsent, self._unsent = self._unsent, []
        items: list[tuple[RequestHandle, RequestOutput | TesseraError]] = []
        for seq, token, logprobs in unsent:
            seq.decode_text()
            final = seq.finish_reason is not None
            text, token_logprobs = seq.detokenizer.take_delta(final), (logprobs,) if logprobs is not None else ()
            if final:
                items.append((self._close(seq), RequestOutput(
                    [token], text, seq.finish_reason, seq.prompt_len, len(seq.output_token_ids), seq.detokenizer.text,
                    token_logprobs)))
            else:
                items.append((self._handles[seq.request_id], RequestOutput([token], text, logprobs=token_logprobs)))
        _deliver(items)
        if unsent:
            self._publish_stats()

    def _fail(self, seq: Sequence, error: TesseraError) -> None:
        self._retire(seq, FinishReason.ABORT, error)

    def _abort(self, seq: Sequence) -> None:
        self._retire(seq, FinishReason.ABORT, RequestOutput(
            [], seq.detokenizer.take_delta(True), FinishReason.ABORT, seq.prompt_len,
            len(seq.output_token_ids), seq.detokenizer.text))

    def _retire(self, seq: Sequence, reason: FinishReason, last: RequestOutput | TesseraError) -> None:
        """Free the request (its id may be reused, stats no longer count it), then send its last item:
        a client that sees the end finds the engine already past it."""
        self._scheduler.finish(seq, reason)
        handle = self._close(seq)
        self._publish_stats()
        _deliver([(handle, last)])

    def _close(self, seq: Sequence) -> RequestHandle:
        """Forget a request whose scheduler resources are freed; -> its handle, for the last item."""
        handle = self._handles.pop(seq.request_id)
        del self._seqs[seq.request_id]
        with self._lock:
            self._in_flight.discard(seq.request_id)
        return handle

    def _publish_stats(self) -> None:
        stats = self._snapshot()
        with self._lock:
            self._stats = stats

    def _snapshot(self) -> EngineStats:
        running = self._scheduler.running
        encoder = self._runner.image_encoder
        images = encoder.cache if encoder is not None else _NO_IMAGE_CACHE
        return EngineStats(
            running_requests=len(running),
            waiting_requests=len(self._scheduler.waiting),
            running_ranks=tuple(seq.rank for seq in running),
            resident_adapters=tuple(self._adapters.resident()),
            free_kv_tokens=self._blocks.free_tokens(),
            preemptions_total=self._scheduler.num_preemptions,
            adapter_slots=self._adapters.num_slots,
            pinned_adapters=self._adapters.num_pinned(),
            generated_tokens_total=self._generated_total,
            prefix_cache_hit_tokens_total=self._blocks.prefix_hit_tokens,
            prefix_cache_query_tokens_total=self._blocks.prefix_query_tokens,
            prefix_cache_blocks=self._blocks.num_cached_blocks,
            prefix_cache_evicted_blocks_total=self._blocks.evicted_blocks,
            image_cache_hits_total=images.hits,
            image_cache_misses_total=images.misses,
            image_cache_evictions_total=images.evictions,
            image_cache_entries=len(images),
            image_cache_bytes=images.bytes_used,
            image_cache_capacity_bytes=images.max_bytes,
            running_load=tuple(map(_seq_load, running)),
            waiting_load=tuple(map(_seq_load, self._scheduler.waiting)))


def _seq_load(seq: Sequence) -> SeqLoad:
    adapter = seq.adapter
    return SeqLoad(adapter.name if adapter else None, adapter.rank if adapter else 0, seq.num_tokens)
