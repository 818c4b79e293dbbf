"""Served Llama-family models with random weights, made on the device from a config alone.

Benchmarks and profiles time the engine at real shapes (a 7B on a GPU) where no checkpoint can be
downloaded; their timings do not depend on the weights' values, only on their shapes and dtype.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from gpu_worker.models.llama import LlamaForCausalLM


def random_llama(config: PretrainedConfig, *, device: torch.device | str, dtype: torch.dtype,
                 seed: int = 0, std: float = 0.02) -> LlamaForCausalLM:
    """The served model of `config`: N(0, std) weights, RMSNorm weights 1, drawn on `device`."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
