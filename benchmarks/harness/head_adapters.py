"""Adapters with VaLoRA's task heads for the benchmarks: random LoRA (as gpu_worker/profile.py's random
adapters) plus a random head (services/demo_heads.py), recorded as the registry records them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from transformers import PretrainedConfig

from benchmarks.harness.shapes import TARGETS
from gpu_worker.lora.loader import AdapterRef, HeadWeights, LoRAWeights
from gpu_worker.models.llama import resolve_dtype
from gpu_worker.profile import random_adapters
from services.common.config import WorkerConfig
from services.common.task_heads import PEFT_MODULE_PREFIX, parse_task_head
from services.demo_heads import DemoHead, head_config, valora_head_tensors


def head_adapters(heads: tuple[DemoHead, ...], hidden: int, rank: int,
                  base_model: str) -> tuple[list[AdapterRef], dict[str, HeadWeights]]:
    """One adapter per head ("head-<kind>"): its ref (the head parsed as the registry parses it) and its head's weights."""
    refs, weights = [], {}
    for index, demo in enumerate(heads):
        tensors = valora_head_tensors(demo, hidden, torch.Generator().manual_seed(index))
        head = parse_task_head(head_config(demo), {name: tuple(t.shape) for name, t in tensors.items()}, hidden)
        name = f"head-{demo.kind}"
        refs.append(AdapterRef(name, base_model, rank, f"{1000 + index:064x}", "", head=head))
        weights[name] = HeadWeights(head, {n: tensors[PEFT_MODULE_PREFIX + n] for n, _ in head.tensors})
    return refs, weights


def adapters_with_heads(text_config: PretrainedConfig, heads: dict[str, HeadWeights],
                        worker: WorkerConfig) -> Callable[[AdapterRef], LoRAWeights]:
    """A loader: random LoRA on TARGETS for every ref, and its head for the refs of `head_adapters`."""
    device = torch.device(worker.device)
    lora = random_adapters(text_config, TARGETS, device, resolve_dtype(worker.dtype, device))

    def load(ref: AdapterRef) -> LoRAWeights:
        weights = lora(ref)
        return weights if ref.head is None else dataclasses.replace(weights, head=heads[ref.name])
    return load
