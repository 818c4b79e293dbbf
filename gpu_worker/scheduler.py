"""Continuous batching: which sequences run in the next forward pass.

Each step keeps every running sequence (one decode token each) and admits waiting ones in FIFO
order while the step stays within max_num_seqs and max_batch_tokens, the KV cache has room, and
the adapter can be given a slot. A request whose adapter cannot get a slot (every slot pinned)
stays waiting without blocking requests behind it; one whose adapter fails to load is failed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpu_worker.kv_cache import KVCache
from gpu_worker.lora.adapter_pool import AdapterPool
from gpu_worker.sequence import FinishReason, Sequence, SequenceStatus
from kernels import NO_SLOT
from services.errors import TesseraError


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_batch_tokens: int


@dataclass
class ScheduledBatch:
    prefills: list[Sequence] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, TesseraError]] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        return self.prefills + self.decodes


class Scheduler:
    def __init__(self, limits: SchedulerLimits, kv_cache: KVCache, adapters: AdapterPool) -> None:
        self.limits = limits
        self.kv_cache = kv_cache
        self.adapters = adapters
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(decodes=list(self.running))
        budget = self.limits.max_batch_tokens - len(batch.decodes)
        still_waiting: deque[Sequence] = deque()
        while self.waiting:
            seq = self.waiting.popleft()
            fits = (len(self.running) < self.limits.max_num_seqs and seq.prompt_len <= budget
                    and self.kv_cache.can_allocate(seq.kv_capacity))
            if not fits:
                still_waiting.append(seq)
                still_waiting.extend(self.waiting)
                self.waiting.clear()
                break
            try:
                admitted = self._admit(seq)
            except TesseraError as exc:
                batch.failed.append((seq, exc))
                continue
            if admitted:
                batch.prefills.append(seq)
                budget -= seq.prompt_len
            else:
                still_waiting.append(seq)  # its adapter waits for a slot; others may go ahead
        self.waiting = still_waiting
        return batch

    def _admit(self, seq: Sequence) -> bool:
        if seq.adapter is not None:
            slot = self.adapters.acquire(seq.adapter)
            if slot is None:
                return False
            seq.slot, seq.rank = slot, self.adapters.rank(slot)
        self.kv_cache.allocate(seq.seq_id, seq.kv_capacity)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire `seq` (finished, aborted or failed): free its KV and unpin its adapter."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.kv_cache.free(seq.seq_id)
            if seq.slot != NO_SLOT:
                self.adapters.release(seq.adapter.name)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
