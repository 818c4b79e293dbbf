"""LoRALinear: a base projection plus stacked adapter slots, applied through `kernels`.

Lifecycle (as in vLLM): created with the base weight; `init_slots` gives it `num_slots` empty
slots (one LoRAStack: per-slot tables of where each adapter's A/B lie in the model's one
AdapterArena, packed at their true ranks; tables and arena never move, so CUDA graphs see fixed
addresses); `set_slot` packs an adapter's A/B into the arena, `reset_slot` frees and empties it;
each forward reads the step's segment -> slot mapping from the forward context. A fused projection
(qkv, gate_up) has one output slice per original projection, and an adapter may target any subset
of them, each at a rank of its own. One class serves every projection.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

import kernels
from gpu_worker.forward_context import get_forward_context
from kernels.lora_stack import packed_elems


class LoRALinear(nn.Module):
    def __init__(self, in_features: int, out_sizes: Sequence[int], *, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_sizes = tuple(out_sizes)
        self.out_features = sum(out_sizes)
        # Slice s is rows out_offsets[s]:out_offsets[s + 1] of the weight and the output.
        self.out_offsets = tuple(sum(self.out_sizes[:s]) for s in range(len(self.out_sizes) + 1))
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        self.lora: kernels.LoRAStack | None = None

    def init_slots(self, num_slots: int, max_rank: int, arena: kernels.AdapterArena) -> None:
        """Give the projection its adapter slots in `arena`, the model's adapter memory (on the weight's
        device and in its dtype: created after the model is moved)."""
        assert arena.dtype == self.weight.dtype and arena.device == self.weight.device, (arena.dtype, arena.device)
        self.lora = kernels.LoRAStack.empty(num_slots, self.in_features, self.out_sizes, max_rank, arena)

    def slot_elems(self, slice_ranks: Sequence[int]) -> int:
        """Arena elements an adapter with these per-slice ranks (0: slice not targeted) needs here."""
        return packed_elems(self.in_features, self.out_sizes, slice_ranks)

    def set_slot(self, slot: int, slices: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
                 scaling: float | Mapping[int, float]) -> None:
        """slices: output slice -> (A [rank, in_features], B [slice out size, rank]); scaling: one, or one
        per targeted slice."""
        assert self.lora is not None, "init_slots first"
        self.lora.set_slot(slot, slices, scaling)

    def reset_slot(self, slot: int) -> None:
        assert self.lora is not None, "init_slots first"
        self.lora.reset_slot(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, out_features]."""
        context = get_forward_context()
        add_cpu_deltas = context.cpu_lora.start(self, x) if context.cpu_lora is not None else None
        out = kernels.linear(x, self.weight, self.bias)
        batch = context.lora
        if self.lora is not None and batch.has_lora:
            for event in context.lora_waits.get(self, ()) if context.lora_waits else ():
                event.wait()  # the device waits for this projection's bytes of an adapter still copying
            y = kernels.lora_shrink(x, self.lora, batch)
            kernels.lora_expand(out, y, self.lora, batch)
        if add_cpu_deltas is not None:
            add_cpu_deltas(out)
        return out
