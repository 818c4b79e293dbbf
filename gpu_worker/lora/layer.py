"""LoRALinear: a base projection plus per-slot LoRA weights, applied through `kernels`.

Lifecycle (as in vLLM): created with the base weight and `num_slots` empty slots; `set_slot`
copies an adapter's A/B in, `reset_slot` empties it; each forward reads the step's segment →
slot mapping from the forward context. One class serves every projection (q/k/v/o/gate/up/down).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from gpu_worker.forward_context import get_forward_context


class LoRALinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, num_slots: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # Per slot: A [rank, in], B [out, rank], scaling alpha / rank; None where the slot's
        # adapter does not target this projection (or the slot is empty).
        self.lora_a: list[torch.Tensor | None] = [None] * num_slots
        self.lora_b: list[torch.Tensor | None] = [None] * num_slots
        self.scalings: list[float] = [0.0] * num_slots

    def set_slot(self, slot: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        rank = a.shape[0]
        assert a.shape == (rank, self.in_features) and b.shape == (self.out_features, rank), (a.shape, b.shape)
        self.lora_a[slot] = a.to(self.weight.device, self.weight.dtype)
        self.lora_b[slot] = b.to(self.weight.device, self.weight.dtype)
        self.scalings[slot] = scaling

    def reset_slot(self, slot: int) -> None:
        self.lora_a[slot] = self.lora_b[slot] = None
        self.scalings[slot] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, out_features]."""
        out = F.linear(x, self.weight, self.bias)
        lora = get_forward_context().lora
        if lora.has_lora:
            y = kernels.lora_shrink(x, self.lora_a, self.scalings, lora)
            kernels.lora_expand(out, y, self.lora_b, lora)
        return out
