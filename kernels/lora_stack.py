"""LoRAStack: every adapter slot's weights for one projection, stacked into a few tensors.

A projection has 1..3 output slices (fused qkv: q, k, v; fused gate_up: gate, up; others: one).
An adapter targets some of them, all with one rank r. Example, a fused qkv of out sizes
(4096, 1024, 1024), an adapter of rank 16 targeting q and v in slot 2:

    out_offsets = (0, 4096, 5120, 6144)
    a[2, 0, :16] = A_q   a[2, 2, :16] = A_v       ranks[2] = [16, 0, 16]
    b[2, :16, 0:4096] = B_qᵀ   b[2, :16, 5120:6144] = B_vᵀ

Storage is padded to max_rank so that slots share one tensor (a CUDA graph reads them by slot
index); the ops read only each slice's true rank, from `ranks`. Both A and B are stored rank-major,
so that an adapter's rank-r rows are dense whatever the padding: with B stored [out, max_rank], a
rank-8 adapter in a rank-128 stack put 16 useful bytes in every 256, and expand touched up to 8x
the cache lines it needed (docs/benchmarks/kernels.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from kernels.batch import LoRABatch


@dataclass(eq=False)  # holds tensors: identity, not value, equality
class LoRAStack:
    a: torch.Tensor              # [num_slots, num_slices, max_rank, in_features] model dtype
    b: torch.Tensor              # [num_slots, max_rank, out_features] Bᵀ; columns of slice s: out_offsets[s]:[s+1]
    ranks: torch.Tensor          # int32 [num_slots, num_slices]; 0: empty slot or slice not targeted
    scalings: torch.Tensor       # float32 [num_slots] alpha / rank of the slot's adapter
    out_offsets: tuple[int, ...]  # [num_slices + 1] host; last == out_features
    host_ranks: list[list[int]]  # [num_slots][num_slices] host mirror of ranks

    def __post_init__(self) -> None:
        num_slots, num_slices, max_rank, _ = self.a.shape
        assert self.b.shape == (num_slots, max_rank, self.out_features), (self.b.shape, self.a.shape)
        assert self.ranks.shape == (num_slots, num_slices) and self.ranks.dtype == torch.int32
        assert self.scalings.shape == (num_slots,) and self.scalings.dtype == torch.float32
        assert len(self.out_offsets) == num_slices + 1 and self.out_offsets[0] == 0
        assert len(self.host_ranks) == num_slots and all(len(r) == num_slices for r in self.host_ranks)

    @property
    def num_slots(self) -> int:
        return self.a.shape[0]

    @property
    def num_slices(self) -> int:
        return self.a.shape[1]

    @property
    def max_rank(self) -> int:
        return self.a.shape[2]

    @property
    def in_features(self) -> int:
        return self.a.shape[3]

    @property
    def out_features(self) -> int:
        return self.out_offsets[-1]

    @staticmethod
    def empty(num_slots: int, in_features: int, out_sizes: Sequence[int], max_rank: int,
              dtype: torch.dtype, device: torch.device | str) -> LoRAStack:
        """All slots empty (rank 0 everywhere); `out_sizes` are the slices' output widths."""
        assert num_slots > 0 and in_features > 0 and max_rank > 0, (num_slots, in_features, max_rank)
        assert len(out_sizes) > 0 and all(n > 0 for n in out_sizes), out_sizes
        out_offsets = (0, *accumulate(out_sizes))
        num_slices = len(out_sizes)
        return LoRAStack(
            a=torch.zeros(num_slots, num_slices, max_rank, in_features, dtype=dtype, device=device),
            b=torch.zeros(num_slots, max_rank, out_offsets[-1], dtype=dtype, device=device),
            ranks=torch.zeros(num_slots, num_slices, dtype=torch.int32, device=device),
            scalings=torch.zeros(num_slots, dtype=torch.float32, device=device),
            out_offsets=out_offsets,
            host_ranks=[[0] * num_slices for _ in range(num_slots)],
        )

    def set_slot(self, slot: int, slices: Mapping[int, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Load one adapter into `slot`: slices maps slice index -> (A [r, in_features], B [out_size, r]).

        Slices absent from the mapping are not targeted (rank 0). The slot is zeroed first so that
        nothing of its previous adapter survives.
        """
        rank = self._check_adapter(slot, slices)
        self.reset_slot(slot)
        for s, (a, b) in slices.items():
            self.a[slot, s, :rank].copy_(a)
            self.b[slot, :rank, self.out_offsets[s]:self.out_offsets[s + 1]].copy_(b.t())
            self.host_ranks[slot][s] = rank
        self.ranks[slot].copy_(torch.tensor(self.host_ranks[slot], dtype=torch.int32))
        self.scalings[slot].fill_(scaling)

    def reset_slot(self, slot: int) -> None:
        """Empty `slot`: zero weights, ranks and scaling."""
        assert 0 <= slot < self.num_slots, (slot, self.num_slots)
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot].zero_()
        self.scalings[slot].zero_()
        self.host_ranks[slot] = [0] * self.num_slices

    def _check_adapter(self, slot: int, slices: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> int:
        """The adapter's rank; ValueError when its weights do not fit this projection."""
        assert 0 <= slot < self.num_slots, (slot, self.num_slots)
        ranks = {a.shape[0] for a, _ in slices.values()}
        if len(ranks) > 1:
            raise ValueError(f"all slices of one adapter must share a rank, got ranks {sorted(ranks)}")
        rank = ranks.pop() if ranks else 0
        if rank > self.max_rank:
            raise ValueError(f"adapter rank {rank} exceeds this projection's max LoRA rank {self.max_rank}; "
                             f"raise the serving max rank or use an adapter of rank <= {self.max_rank}")
        for s, (a, b) in slices.items():
            if not 0 <= s < self.num_slices:
                raise ValueError(f"slice {s} out of range: this projection has {self.num_slices} slices")
            out_size = self.out_offsets[s + 1] - self.out_offsets[s]
            if a.shape != (rank, self.in_features) or b.shape != (out_size, rank):
                raise ValueError(f"slice {s}: expected A {(rank, self.in_features)} and B {(out_size, rank)}, "
                                 f"got A {tuple(a.shape)} and B {tuple(b.shape)}")
        return rank

    def check_shrink_args(self, x: torch.Tensor, batch: LoRABatch) -> None:
        """x: [num_tokens, in_features] on this stack's device."""
        assert x.dim() == 2 and x.shape == (batch.num_tokens, self.in_features), (x.shape, batch.num_tokens)
        assert x.device == self.a.device == batch.lens.device, (x.device, self.a.device, batch.lens.device)

    def check_expand_args(self, out: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        """out: [num_tokens, out_features]; y: [splits, num_tokens, num_slices, max_rank] from
        lora_shrink: float32, or one plane in the dtype of the stack that computed it."""
        assert out.dim() == 2 and out.shape == (batch.num_tokens, self.out_features), (out.shape, batch.num_tokens)
        assert out.is_floating_point(), out.dtype
        assert y.is_floating_point() and (y.dtype == torch.float32 or y.shape[0] == 1) and y.dim() == 4 and (
            y.shape[1:] == (batch.num_tokens, self.num_slices, self.max_rank)), (y.dtype, y.shape)
        assert out.device == y.device == self.b.device == batch.lens.device, (out.device, y.device)
