"""Rotary position embeddings with the checkpoint's rope scaling honored.

The inverse frequencies come from transformers' ROPE_INIT_FUNCTIONS (llama3, yarn, linear, ...)
for scaled checkpoints and from the default formula otherwise, so positions match the
reference implementation exactly. Packed tokens carry their own positions. The rotation itself
is applied by kernels.rotary_store_kv.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _default_inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    base = config.rope_parameters["rope_theta"]
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim)), 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            inv_freq, self.attention_scaling = _default_inv_freq(config, head_dim)
        elif rope_type == "dynamic":
            raise ValueError("dynamic NTK rope scaling depends on the sequence length; not supported")
        else:
            with torch.device("cpu"):  # real values even while the model is built on the meta device
                inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
            inv_freq = inv_freq.float()
        # A plain float32 tensor, not a buffer: model.to(bfloat16) must not round it. Copied to the
        # positions' device at the first step (never during CUDA-graph capture, which runs after warm-up).
        self.inv_freq = inv_freq  # [head_dim / 2]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens] -> cos, sin: [num_tokens, head_dim] in dtype, computed once per step
        and read by every layer's kernels.rotary_store_kv."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]   # [num_tokens, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
