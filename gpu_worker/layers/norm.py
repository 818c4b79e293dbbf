"""RMSNorm as in Llama: computed in float32, scaled by the weight in the input dtype (kernels.fused)."""

from __future__ import annotations

import torch
from torch import nn

from kernels import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [num_tokens, hidden] -> normed x; with a residual (same shape), the previous sublayer's
        add is fused in: -> (normed x + residual, x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
