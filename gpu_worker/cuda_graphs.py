"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

A decode step launches hundreds of small kernels; replaying a captured graph removes the launch
gaps. Everything that changes between steps lives in static device buffers that the graph reads:
token ids, positions, KV slots, block tables, context lengths and the LoRA segment table (which
adapter slot each run of tokens uses). So a batch that mixes adapters replays the same graph as a
batch with one adapter.

Kernel configurations (tile sizes, split counts) are fixed when a graph is captured, so each
bucket has a few graphs, picked at replay from host facts about the batch:
- LoRA mode: none (a base-only batch pays nothing for LoRA); one token per segment (every
  sequence on its own adapter: 1-row tiles); grouped (sequences sharing adapters form longer
  segments: tensor-core tiles, few programs each spread wide);
- context bound: short contexts (<= SHORT_CONTEXT) split attention's keys less than long ones.

Padding rows (bucket larger than the batch) run one token with context 1 whose K/V go to the
scratch block, and belong to no LoRA segment.
"""

from __future__ import annotations

import enum
import itertools
import logging

import torch

from gpu_worker.block_manager import SCRATCH_BLOCK
from gpu_worker.forward_context import ForwardContext, forward_context
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.step_inputs import InFlightIds, StepInputs
from kernels import NO_SLOT, LoRABatch
from kernels.attention import AttentionMetadata

log = logging.getLogger(__name__)

SHORT_CONTEXT = 512


class LoRAMode(enum.Enum):
    NONE = "none"
    TOKENS = "tokens"     # every adapter's group one token long
    GROUPED = "grouped"   # some adapter's group longer than one token


def lora_mode(seg_lens: list[int], seg_slots: list[int]) -> LoRAMode:
    used = [n for n, slot in zip(seg_lens, seg_slots) if slot != NO_SLOT]
    if not used:
        return LoRAMode.NONE
    return LoRAMode.TOKENS if max(used) == 1 else LoRAMode.GROUPED


def batch_buckets(max_batch: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache, *, max_batch: int,
                 max_context: int, with_lora: bool) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        self.max_context = max_context
        device = model.lm_head.weight.device
        width = -(-max_context // kv_cache.block_size)  # block-table entries per sequence
        # The graph's inputs live in two device tensors (one per dtype), staged in pinned host
        # memory, so a replay costs two host-to-device copies whatever the batch holds. Two sets of
        # staging buffers take turns: with async scheduling the next step is staged while the copy
        # of the step before may still wait behind the device's work.
        self._staging = [(torch.zeros(3, max_batch, dtype=torch.long).pin_memory(),
                          torch.zeros(4 + width, max_batch, dtype=torch.int32).pin_memory()) for _ in range(2)]
        self._replays = 0
        self._dev_i64 = torch.zeros_like(self._staging[0][0], device=device)
        self._dev_i32 = torch.zeros_like(self._staging[0][1], device=device)
        self._input_ids, self._positions, self._slot_mapping = self._dev_i64
        self._seq_lens, self._seg_starts, self._seg_lens, self._seg_slots = self._dev_i32[:4]
        self._block_tables = self._dev_i32[4:].view(max_batch, width)  # row-major [max_batch, width]
        self._query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._context_bounds = sorted({min(SHORT_CONTEXT, max_context), max_context})
        self._graphs: dict[tuple[int, LoRAMode, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._capture_all(with_lora)

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch

    def _bucket(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    def _forward(self, bucket: int, mode: LoRAMode, context_bound: int) -> torch.Tensor:
        attention = AttentionMetadata(
            query_start_loc=self._query_start_loc[:bucket + 1], seq_lens=self._seq_lens[:bucket],
            block_tables=self._block_tables[:bucket], slot_mapping=self._slot_mapping[:bucket],
            max_query_len=1, max_seq_len=context_bound)
        # The host-side segment view only chooses whether LoRA kernels are recorded and with which
        # configuration; the kernels read the device segment table, rewritten before every replay.
        # TOKENS: every token its own slot (one-token groups); GROUPED: one group as large as the bucket.
        seg_slots = {LoRAMode.NONE: (NO_SLOT,), LoRAMode.TOKENS: tuple(range(bucket)), LoRAMode.GROUPED: (0,)}[mode]
        seg_lens = (1,) * bucket if mode is LoRAMode.TOKENS else (bucket,)
        lora = LoRABatch(num_tokens=bucket, seg_starts=tuple(range(0, bucket, seg_lens[0])), seg_lens=seg_lens,
                         seg_slots=seg_slots, max_group_len=max(seg_lens), starts=self._seg_starts[:bucket],
                         lens=self._seg_lens[:bucket], slots=self._seg_slots[:bucket])
        with forward_context(ForwardContext(attention, self.kv_cache, lora)):
            hidden = self.model(self._input_ids[:bucket], self._positions[:bucket])
        return self.model.compute_logits(hidden)

    def _modes(self, bucket: int, with_lora: bool) -> list[LoRAMode]:
        if not with_lora:
            return [LoRAMode.NONE]
        return [LoRAMode.NONE, LoRAMode.TOKENS] + ([LoRAMode.GROUPED] if bucket > 1 else [])

    @torch.inference_mode()
    def _capture_all(self, with_lora: bool) -> None:
        self._seq_lens.fill_(1)
        self._slot_mapping.fill_(SCRATCH_BLOCK * self.kv_cache.block_size)
        self._seg_slots.fill_(NO_SLOT)
        self._block_tables.fill_(SCRATCH_BLOCK)
        for bucket in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory
            for key in itertools.product([bucket], self._modes(bucket, with_lora), self._context_bounds):
                for _ in range(2):  # compile kernels and settle allocations outside the capture
                    self._forward(*key)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    logits = self._forward(*key)
                self._graphs[key] = (graph, logits)
        torch.cuda.synchronize()
        log.info("captured %d decode graphs for batch buckets %s", len(self._graphs), self.buckets)

    def replay(self, inputs: StepInputs, in_flight: InFlightIds | None = None) -> torch.Tensor:
        """Decode-only `inputs` -> float32 logits [batch, vocab] (a view into the graph's output).
        `in_flight` replaces the host's placeholders for ids still on the device."""
        n, num_segs = len(inputs.items), len(inputs.seg_lens)
        bucket = self._bucket(n)
        host_i64, host_i32 = self._staging[self._replays % 2]
        self._replays += 1
        i64, i32 = host_i64.numpy(), host_i32.numpy()
        i64[0, :n], i64[1, :n], i64[2, :n] = inputs.input_ids, inputs.positions, inputs.slot_mapping
        i64[2, n:bucket] = SCRATCH_BLOCK * self.kv_cache.block_size
        i32[0, :n], i32[0, n:bucket] = inputs.seq_lens, 1
        i32[2, :num_segs], i32[3, :num_segs] = inputs.seg_lens, inputs.seg_slots
        i32[1, :num_segs] = [0, *itertools.accumulate(inputs.seg_lens)][:num_segs]
        i32[2, num_segs:bucket], i32[3, num_segs:bucket] = 0, NO_SLOT
        tables = i32[4:].reshape(-1)
        width = self._block_tables.shape[1]
        for row, table in enumerate(inputs.block_tables):  # entries past a table's end are never read
            tables[row * width:row * width + len(table)] = table
        tables[n * width:bucket * width:width] = SCRATCH_BLOCK
        self._dev_i64.copy_(host_i64, non_blocking=True)
        self._dev_i32.copy_(host_i32, non_blocking=True)
        if in_flight is not None:
            in_flight.write_into(self._input_ids[:n])
        mode = lora_mode(inputs.seg_lens, inputs.seg_slots)  # one sequence: never GROUPED
        context_bound = next(c for c in self._context_bounds if c >= max(inputs.seq_lens))
        graph, logits = self._graphs[(bucket, mode, context_bound)]
        graph.replay()
        return logits[:n]
