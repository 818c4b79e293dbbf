"""Continuous batching over a token budget, with chunked prefill and preemption by recompute.

Every step is built from the sequences' pending tokens (vLLM v1's view): a decoding sequence has
one, a prefilling one the rest of its prompt. Running sequences go first, decodes before prefill
chunks, so a long prompt never stalls the decodes; then waiting sequences are admitted in FIFO
order while the step stays within max_batch_tokens and max_num_seqs and the KV cache has blocks;
a sequence whose adapter is not usable on the GPU yet (lora/adapter_manager.py: the load started when
the request arrived) starts as policy/cold_start.py decides — layer-pipelined while its copy runs, on
the CPU LoRA workers, or later — and waits while those behind it go ahead; one whose adapter failed to
load fails at once, wherever it is in the queue. An admitted sequence whose leading blocks are in the prefix cache starts
its prefill after them. A prompt longer than the remaining budget is prefilled in chunks over
several steps. When a running sequence needs a block and none is free, the newest running
sequence is preempted: its blocks are freed and it goes back to the head of the queue, to be
recomputed (prompt and outputs so far) when blocks free up.

With async scheduling the engine calls `schedule` while the step before still runs on the device:
only the token counts matter here, and a token still in flight counts (`Sequence.num_in_flight`).
A sequence that has sampled every token it may produce (its finish is known, or its last token is
in flight) is not scheduled again; the engine releases it once that step completes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_worker.block_manager import BlockManager
from gpu_worker.lora.adapter_manager import AdapterManager, AdapterWhere
from policy.cold_start import ColdOptions, ColdStart, ColdStartPolicy
from gpu_worker.lora.gpu_memory import AdapterCopy
from gpu_worker.lora.host_weights import PackedAdapter
from gpu_worker.sequence import FinishReason, Sequence, SequenceStatus
from kernels import NO_SLOT
from services.common.errors import TesseraError


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_batch_tokens: int


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new: int      # tokens this sequence runs in the step
    samples: bool     # the step completes its pending tokens, so a token is sampled for it


@dataclass
class ScheduledBatch:
    items: list[ScheduledSeq] = field(default_factory=list)
    failed: list[tuple[Sequence, TesseraError]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    adapter_copies: list[AdapterCopy] = field(default_factory=list)  # the step's kernels wait for these

    def add(self, seq: Sequence, num_new: int) -> None:
        # A head request samples nothing: its head answers once its prompt ran (step_inputs.head_rows).
        self.items.append(ScheduledSeq(seq, num_new, seq.head is None and seq.num_cached + num_new == seq.num_tokens))

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new for item in self.items)


class Scheduler:
    def __init__(self, limits: SchedulerLimits, blocks: BlockManager, adapters: AdapterManager,
                 cold_start: ColdStartPolicy, cpu_extra_s: Callable[[int, PackedAdapter], float | None] = lambda tokens, packed: None) -> None:
        """`cold_start`: how sequences start whose adapter is not usable on the GPU; `cpu_extra_s`: what running a sequence's tokens of an adapter
        on the CPU LoRA workers adds to a step (lora/cpu_assist.py), None without them."""
        self.limits = limits
        self.blocks = blocks
        self.adapters = adapters
        self.cold_start = cold_start
        self.cpu_extra_s = cpu_extra_s
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """A request arrived: its adapter's load starts now, and its pin holds until `finish`."""
        if seq.adapter is not None:
            self.adapters.arrive(seq.adapter)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, may_run: Callable[[Sequence], bool] | None = None) -> ScheduledBatch:
        """The next step. `may_run`: the sequences the step may run (the orchestrator's choice for its
        mode); the others keep their place, and their blocks, for a later step."""
        batch = ScheduledBatch()
        self.adapters.poll()
        self._fail_unloadable(batch)
        budget = self.limits.max_batch_tokens
        # Decodes first (stable sort keeps admission order within each group); the tail, where
        # victims are taken from, then holds the newest prefills.
        self.running.sort(key=lambda s: s.num_pending > 1)
        for seq in self.running:
            if seq.cpu_adapter is not None:
                self._move_to_gpu(seq)
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.sampled_all or (may_run is not None and not may_run(seq)):
                index += 1
                continue
            num_new = min(seq.num_pending, budget)
            if not self._make_room(seq, num_new, batch):
                break  # `seq` itself was preempted, and so was everything after it
            self.blocks.grow(seq, num_new)
            batch.add(seq, num_new)
            budget -= num_new
            index += 1
        if not batch.preempted:  # blocks are short: admitting more would only preempt again
            self._admit_waiting(batch, budget, may_run)
        return batch

    def _make_room(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        """Preempt from the tail of `running` until `seq` can grow; False if `seq` was preempted."""
        while not self.blocks.can_grow(seq, num_new):
            victim = self.running[-1]
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, may_run: Callable[[Sequence], bool] | None) -> None:
        still_waiting: deque[Sequence] = deque()
        while self.waiting:
            seq = self.waiting.popleft()
            if budget <= 0 or len(self.running) >= self.limits.max_num_seqs or (may_run is not None and not may_run(seq)):
                still_waiting.append(seq)
                continue
            prefix = self.blocks.match_prefix(seq)  # prefill starts after the blocks it reuses
            num_new = min(seq.num_pending - len(prefix) * self.blocks.block_size, budget)
            if not self.blocks.can_admit(prefix, num_new):
                still_waiting.append(seq)  # FIFO: nobody behind it jumps the queue for blocks
                still_waiting.extend(self.waiting)
                self.waiting.clear()
                break
            if not self._place_adapter(seq, batch, num_new):
                still_waiting.append(seq)  # its adapter is loading; others may go ahead
                continue
            self.blocks.admit(seq, prefix, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new
        self.waiting = still_waiting

    def _fail_unloadable(self, batch: ScheduledBatch) -> None:
        """Fail the waiting sequences whose adapter could not be loaded (AdapterLoadFailed)."""
        if not self.adapters.failing:  # the usual pass: no failure to look for in the queue
            return
        failed = [(seq, error) for seq in self.waiting
                  if seq.adapter is not None and (error := self.adapters.where(seq.adapter).error) is not None]
        for seq, error in failed:
            self.waiting.remove(seq)
            batch.failed.append((seq, error))

    def _place_adapter(self, seq: Sequence, batch: ScheduledBatch, num_new: int) -> bool:
        """Point `seq` at its adapter's GPU slot, or its host copy for the CPU LoRA workers, as the cold-start
        policy says; False while it waits for its adapter."""
        if seq.adapter is None:
            return True
        where = self.adapters.where(seq.adapter)
        placed = (where.slot, where.rank) if where.usable else None
        if placed is None:
            seq.cold = True
            way = self._cold_start_way(where, batch, num_new)
            if way is ColdStart.WAIT:
                return False
            if way is ColdStart.CPU and seq.head is not None:
                return False  # its head is read on the GPU: it waits for the copy, and others go ahead
            if way is ColdStart.CPU:
                seq.cpu_adapter = where.host
            else:  # pipelined: the step's kernels wait on the device for the copy's bytes
                placed = where.slot, where.rank
                if where.copy is not None and where.copy not in batch.adapter_copies:
                    batch.adapter_copies.append(where.copy)
        elif seq.cold:
            way = ColdStart.WAIT  # it waited, and its adapter is usable now
        if seq.cold:
            self.cold_start.started[way] += 1
            seq.cold = False
        if placed is not None:
            seq.slot, seq.rank = placed
        return True

    def _cold_start_way(self, where: AdapterWhere, batch: ScheduledBatch, num_new: int) -> ColdStart:
        if where.host is None:
            return ColdStart.WAIT  # still on its way from disk
        slos = [item.seq.tpot_slo_s for item in batch.items if item.seq.tpot_slo_s]
        return self.cold_start.choose(ColdOptions(where.copy_left_s, self.cpu_extra_s(num_new, where.host),
                                                  others=bool(batch.items), tpot_slo_s=min(slos, default=None)))

    def _move_to_gpu(self, seq: Sequence) -> None:
        """A CPU-assisted sequence takes the GPU kernels from the first step after its adapter is usable
        there (a prefill switches at a chunk's boundary)."""
        placed = self.adapters.resident(seq.adapter)
        if placed is not None:
            seq.slot, seq.rank = placed
            seq.cpu_adapter = None

    def _release(self, seq: Sequence) -> None:
        """Give back the KV blocks of a running sequence (its adapter stays pinned until `finish`)."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.slot = NO_SLOT
        seq.cpu_adapter = None

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.head_hidden.clear()  # recomputed with its K/V
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire `seq` (finished, aborted or failed): free its KV blocks and unpin its adapter."""
        assert seq.status is not SequenceStatus.FINISHED, seq.request_id
        if seq.status is SequenceStatus.RUNNING:
            self._release(seq)
        elif seq in self.waiting:  # not when _fail_unloadable took it out
            self.waiting.remove(seq)
        if seq.adapter is not None:
            self.adapters.depart(seq.adapter)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
