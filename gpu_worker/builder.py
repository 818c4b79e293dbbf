"""Assembles an Engine from a checkpoint directory and the worker's configuration."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoTokenizer

from gpu_worker.engine import Engine, StepRecord
from gpu_worker.kv_cache import CacheShape, ContiguousKVCache
from gpu_worker.lora.adapter_pool import AdapterPool
from gpu_worker.lora.loader import AdapterRef, LoRAWeights, load_adapter
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.llama import LORA_TARGETS, load_model, resolve_dtype
from gpu_worker.scheduler import Scheduler, SchedulerLimits
from services.config import WorkerConfig


def build_engine(checkpoint_dir: Path, worker: WorkerConfig, adapter_store: Path,
                 on_step: Callable[[StepRecord], None] | None = None) -> Engine:
    device = torch.device(worker.device)
    dtype = resolve_dtype(worker.dtype, device)
    model = load_model(checkpoint_dir, device=device, dtype=dtype, num_slots=worker.adapter_slots)
    config = model.config
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    max_context = config.max_position_embeddings
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # Budget: every admitted sequence may use a whole context window.
    kv_cache = ContiguousKVCache(
        CacheShape(config.num_hidden_layers, config.num_key_value_heads, head_dim, dtype, device),
        capacity_tokens=worker.max_num_seqs * max_context)

    def load(ref: AdapterRef) -> LoRAWeights:
        return load_adapter(ref, adapter_store, LORA_TARGETS, config.num_hidden_layers)

    adapters = AdapterPool(model.lora_layers(), worker.adapter_slots, load)
    scheduler = Scheduler(SchedulerLimits(worker.max_num_seqs, worker.max_batch_tokens), kv_cache, adapters)
    return Engine(base_model=worker.base_model, runner=ModelRunner(model, kv_cache, device), scheduler=scheduler,
                  kv_cache=kv_cache, adapters=adapters, tokenizer=tokenizer, max_context=max_context, on_step=on_step)
