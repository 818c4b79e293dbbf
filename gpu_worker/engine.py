"""The serving engine: a thread that loops schedule → plan → run → postprocess → publish.

Callers on the asyncio side `submit_async` a request and get a RequestHandle: the intake validates
and tokenizes it on one of the engine's intake threads, so bad input fails in the caller and a huge
prompt or image delays only itself, never the caller's event loop (`submit` does the same on the
calling thread). The engine thread streams each step's outputs to the handles (delivery.py). `abort`
retires a request whose client went away. All scheduler state is touched by the engine thread only;
other threads talk to it through the inbox. A request's adapter starts loading as the engine thread
takes the request from the inbox (lora/adapter_manager.py); the load runs beside the steps, and a
finished load posts to the inbox, so an engine with nothing to run but requests waiting for their
adapters sleeps on the inbox until one is ready. The registry's orders for the adapter tiers (retire,
pin, preload: policy/placement_orders.py) come through the inbox too; an engine with no request at all
still advances their loads on each message.

A step's host work is split around the device. What the next schedule needs (token ids, whether
each request finished, freeing finished requests' blocks) runs as soon as the tokens arrive
(`_postprocess`); the rest (detokenizing, streaming outputs, stats) waits until the next step is on
the device and runs while the device works (`_send_outputs`), so the host's share of a decode step
hides behind the device (figures: docs/benchmarks/engine.md). Pending outputs are always sent
before the inbox is applied and before the engine idles, so aborts and shutdown see every request
as before.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase, ProcessorMixin

from gpu_worker.block_manager import BlockManager
from gpu_worker.delivery import RequestHandle, RequestOutput, Streams, aborted_output, deliver
from gpu_worker.heads import HeadAnswers
from gpu_worker.intake import GenerationRequest, Intake
from gpu_worker.lora.adapter_manager import AdapterManager
from policy.cold_start import ColdStartPolicy
from policy.placement_orders import OrderBook, PlacementOrders
from gpu_worker.model_runner import ModelRunner
from gpu_worker.orchestrator import InferenceMode, Orchestrator, StepPlan
from gpu_worker.sampler import SampledTokens, sample
from gpu_worker.scheduler import ScheduledBatch, Scheduler
from gpu_worker.sequence import FinishReason, Sequence, SequenceStatus
from gpu_worker.stats import EngineStats, snapshot
from services.common.errors import Internal, TesseraError

log = logging.getLogger(__name__)

# Tokenizers (Rust) and image decoding (PIL) drop the GIL for their heavy part, so intake threads work
# beside the engine thread. Half the cores stay with the engine, the event loop and gRPC; at least 2,
# so that one huge prompt in intake leaves a thread for the next request's.
INTAKE_THREADS = max(2, min(8, (os.cpu_count() or 1) // 2))


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
    mode: str = "unmerged"             # the step's inference mode (orchestrator.py's InferenceMode values)
    starving: int = 0                  # requests past their credit threshold when its mode was decided


@dataclass(frozen=True)
class _LaunchedStep:
    batch: ScheduledBatch
    sampled: SampledTokens
    answers: HeadAnswers  # the task-head requests whose prompt the step completed
    started: float
    merged_adapter: str | None  # folded into the base weights for this step
    mode: str
    starving: int


class Engine:
    def __init__(self, *, base_model: str, runner: ModelRunner, scheduler: Scheduler, orchestrator: Orchestrator,
                 adapters: AdapterManager, cold_start: ColdStartPolicy, tokenizer: PreTrainedTokenizerBase, max_context: int, max_lora_rank: int,
                 async_scheduling: bool, on_step: Callable[[StepRecord], None] | None = None,
                 processor: ProcessorMixin | None = None) -> None:
        self.base_model = base_model
        self._runner = runner
        self._scheduler = scheduler
        self._orchestrator = orchestrator
        self._blocks: BlockManager = scheduler.blocks
        self._adapters = adapters
        self._cold_start = cold_start  # the scheduler's and the orchestrator's too: it learns each step's time here
        adapters.wake = lambda: self._inbox.put(("adapters", None))  # a load finished (loader or copy thread)
        self._orders = OrderBook(adapters.residency)
        self.max_context = max_context
        self._intake = Intake(base_model=base_model, tokenizer=tokenizer, processor=processor, max_context=max_context,
                              max_lora_rank=max_lora_rank, kv_capacity_tokens=self._blocks.capacity_tokens)
        self._intake_threads = concurrent.futures.ThreadPoolExecutor(INTAKE_THREADS, thread_name_prefix="intake")
        self._streams = Streams(on_close=self._intake.release)  # engine thread only
        self._on_step = on_step
        self._eos = tokenizer.eos_token_id
        self._inbox: queue.SimpleQueue[tuple[str, object] | None] = queue.SimpleQueue()
        self._step = 0
        self._generated_total = 0
        self._busy_s = 0.0  # steps' launch-to-tokens time, overlaps counted once (EngineStats.busy_seconds_total)
        self._last_step_done = 0.0
        self._adapter_requests: collections.Counter[str] = collections.Counter()  # by adapter name, since start
        self._async_scheduling = async_scheduling
        self._launched: _LaunchedStep | None = None  # the step on the device whose tokens are not taken yet
        self._stalled = False  # the last step found nothing to run: sleep on the inbox until something changes
        self._stats_lock = threading.Lock()
        self._stats = self._snapshot()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # --- caller side (any thread) ---

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._intake_threads.shutdown(cancel_futures=True)
        self._inbox.put(None)
        self._thread.join()
        self._runner.close()
        self._adapters.close()

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> RequestHandle:
        """Validate and tokenize `request` on this thread and queue it; its outputs stream on `loop`.
        Raises InvalidArgument or AlreadyExists."""
        seq, handle = self._intake.accept(request, loop)
        self._inbox.put(("add", (seq, handle)))
        return handle

    async def submit_async(self, request: GenerationRequest) -> RequestHandle:
        """`submit` on an intake thread: the running loop streams other requests meanwhile. A caller
        cancelled while its request is in intake leaves nothing behind (the request is aborted once
        queued)."""
        loop = asyncio.get_running_loop()
        submitted = loop.run_in_executor(self._intake_threads, self.submit, request, loop)
        try:
            return await asyncio.shield(submitted)
        except asyncio.CancelledError:
            submitted.add_done_callback(self._abort_submitted)
            raise

    def _abort_submitted(self, submitted: asyncio.Future[RequestHandle]) -> None:
        if not submitted.cancelled() and submitted.exception() is None:
            self.abort(submitted.result().request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def apply_orders(self, orders: PlacementOrders) -> None:
        """The registry's latest orders for the adapter tiers (applied on the engine thread)."""
        self._inbox.put(("orders", orders))

    def stats(self) -> EngineStats:
        with self._stats_lock:
            return self._stats

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows (added tokens included): valid ids are [0, vocab_size)."""
        return self._intake.vocab_size

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each id decoded alone, special tokens kept ("</s>"): the `token` of log-probability entries."""
        return self._intake.token_texts(ids)

    # --- engine thread ---

    def _loop(self) -> None:
        while True:
            idle = self._launched is None and (self._stalled or not self._scheduler.has_work())
            if idle:
                self._send_outputs()
                if not self._scheduler.has_work():  # else the next step polls: requests wait for these loads
                    self._adapters.poll()  # loads no request waits for: an operator's pins and preloads
                    self._publish_stats()
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
            if self._streams.find(seq.request_id) is seq:
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
            if message is None or message[0] == "abort":
                self._settle()  # aborts and shutdown find every request as its last step left it
            if message is None:
                for seq in self._streams.sequences():
                    self._abort(seq)
                return False
            kind, payload = message
            if kind == "add":
                seq, handle = payload
                self._streams.open(seq, handle)
                self._scheduler.add(seq)  # its adapter starts loading now
                if seq.adapter is not None:
                    self._adapter_requests[seq.adapter.name] += 1
            elif kind == "abort" and (seq := self._streams.find(payload)) is not None:
                self._abort(seq)
            elif kind == "orders":
                self._orders.apply(payload)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                self._publish_stats()
                return True

    def _settle(self) -> None:
        """Finish the step in flight, if any, and send every pending output."""
        launched, self._launched = self._launched, None
        self._postprocess(launched)
        self._send_outputs()

    def step(self) -> None:
        """Schedule a batch, plan its mode, launch it, take the tokens of the step before, then publish
        its blocks and outputs while the device runs. With async scheduling the step before is still
        on the device at launch (the new step reads its tokens there), and this step stays in flight
        until the next call."""
        previous, self._launched = self._launched, None
        batch = self._schedule(self._orchestrator.shape(self._scheduler))
        self._stalled = previous is None and not (batch.items or batch.preempted or batch.failed)
        if not batch.items:
            self._skip(previous)
            return
        plan = self._orchestrator.plan(batch)
        if plan.mode is not InferenceMode.UNMERGED:
            for copy in batch.adapter_copies:  # a merge reads the whole adapter: the device waits for it
                copy.done.wait()
        launched = self._launch(batch, plan, previous)
        self._postprocess(previous)
        self._publish(batch)
        if self._async_scheduling:
            self._launched = launched
        else:
            self._postprocess(launched)

    def _schedule(self, may_run: Callable[[Sequence], bool] | None) -> ScheduledBatch:
        batch = self._scheduler.schedule(may_run)
        for seq, error in batch.failed:
            self._fail(seq, error)
        return batch

    def _skip(self, previous: _LaunchedStep | None) -> None:
        """Nothing to launch: take the step before's tokens (its requests may have sampled their last
        ones) and send them."""
        self._postprocess(previous)
        self._send_outputs()
        if previous is None:
            self._publish_stats()

    def _launch(self, batch: ScheduledBatch, plan: StepPlan, previous: _LaunchedStep | None) -> _LaunchedStep:
        """Run `batch` as `plan` says and sample on the device; the tokens reach the host in `_postprocess`."""
        started = time.perf_counter()
        sampling, logits, answers = self._runner.run(batch.items, plan, previous.sampled if previous is not None
                                                     else None, batch.adapter_copies)
        for seq in sampling:
            seq.num_in_flight += 1
        return _LaunchedStep(batch, sample(logits, sampling), HeadAnswers(answers), started,
                             self._runner.merged_adapter, plan.mode.value, self._orchestrator.starving)

    def _postprocess(self, launched: _LaunchedStep | None) -> None:
        """Take a launched step's tokens, if there is one: append them, decide which requests finished
        and free those that no launched step still runs. Streaming waits for `_send_outputs`."""
        if launched is None:
            return
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
            self._streams.push(seq, token, token_logprobs)
        for seq, answer in zip(launched.answers.seqs, launched.answers.result()):
            if seq.finish_reason is None:  # not aborted while its step ran
                seq.finish_reason = FinishReason.STOP
                self._release(seq)
                self._streams.answer(seq, answer)
        self._step += 1
        done = time.perf_counter()
        duration_s = done - launched.started
        self._busy_s += done - max(launched.started, self._last_step_done)  # the next step launched before this one ended
        self._last_step_done = done
        self._cold_start.observe_step(duration_s)
        if self._on_step is not None:
            batch, seqs = launched.batch, [item.seq for item in launched.batch.items]
            self._on_step(StepRecord(
                self._step, tuple(s.request_id for s in seqs), tuple(s.adapter.name if s.adapter else None for s in seqs),
                sum(1 for item in batch.items if item.num_new > 1 or not item.samples), batch.num_tokens,
                len(batch.preempted), duration_s, launched.merged_adapter, launched.mode, launched.starving))

    def _publish(self, batch: ScheduledBatch) -> None:
        """Offer the batch's blocks to the prefix cache (after the step before's tokens: its block
        hashes may cover them), then stream the step before's outputs while the device runs this one."""
        for item in batch.items:
            self._blocks.publish(item.seq)  # before retiring: a finished prompt's blocks stay reusable
        self._send_outputs()

    def _release(self, seq: Sequence) -> None:
        """Free a finished request's blocks and adapter pin, unless a launched step still runs it
        (its last token there is dropped, and that step's postprocessing frees it)."""
        if seq.num_in_flight == 0 and seq.status is not SequenceStatus.FINISHED:
            self._scheduler.finish(seq, seq.finish_reason)

    def _send_outputs(self) -> None:
        """Detokenize the unsent tokens and stream them; close the requests they finished."""
        if self._streams.flush():
            self._publish_stats()

    def _fail(self, seq: Sequence, error: TesseraError) -> None:
        self._retire(seq, FinishReason.ABORT, error)

    def _abort(self, seq: Sequence) -> None:
        self._retire(seq, FinishReason.ABORT, aborted_output(seq))

    def _retire(self, seq: Sequence, reason: FinishReason, last: RequestOutput | TesseraError) -> None:
        """Free the request (its id may be reused, stats no longer count it), then send its last item:
        a client that sees the end finds the engine already past it."""
        self._scheduler.finish(seq, reason)
        handle = self._streams.close(seq)
        self._publish_stats()
        deliver([(handle, last)])

    def _publish_stats(self) -> None:
        stats = self._snapshot()
        with self._stats_lock:
            self._stats = stats

    def _snapshot(self) -> EngineStats:
        encoder = self._runner.image_encoder
        return snapshot(self._scheduler, self._adapters, encoder.cache if encoder is not None else None,
                        self._generated_total, self._busy_s, self._runner.cpu_lora, self._adapter_requests)
