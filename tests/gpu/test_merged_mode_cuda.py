"""Merged mode at default settings (issue 41): on a 7B-shaped model (Llama-2-7B config, random bf16
weights) with an adapter on all seven projections, the base weights' backups are reserved before the
KV cache is sized on what is left, so a run of steps on that adapter folds it into the weights. And
tests/unit/gpu_worker/test_merged_mode.py's engine checks on a float32 CUDA engine (CUDA graphs for
decode, mixture steps eager) against transformers + PEFT."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from benchmarks.harness.adapter_files import AdapterShape, AdapterStore
from benchmarks.harness.prompts import Requests
from benchmarks.harness.serving import BASE_MODEL, bench_tokenizer, running_engine, serve
from benchmarks.harness.shapes import ALL_SEVEN, LLAMA2_7B
from gpu_worker.builder import assemble_parts
from gpu_worker.models.random_weights import random_llama
from services.common.config import WorkerConfig
from tests.unit.gpu_worker.test_merged_mode import (  # noqa: F401 (run here on CUDA)
    test_mixture_mode_gives_peft_outputs_for_every_adapter_and_the_base_model,
    test_one_adapter_runs_merged_then_base_weights_come_back_exactly,
    test_switching_adapters_never_drifts_the_base_weights,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_merged_mode_engages_at_default_settings_on_a_7b(tmp_path):
    device, config = torch.device("cuda"), LlamaConfig(**LLAMA2_7B)
    model = random_llama(config, device=device, dtype=torch.bfloat16)
    adapter = AdapterStore(tmp_path, config, BASE_MODEL, torch.bfloat16, device).new(AdapterShape(64, ALL_SEVEN))
    worker = WorkerConfig(device="cuda", base_model=BASE_MODEL)  # every other setting its default
    parts = assemble_parts(model, worker, tmp_path)
    switch = parts.runner.merge_switch
    projections = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "layers." in name
                      and name.endswith("proj.weight"))
    assert switch.available and switch.reserved_bytes == projections  # every adapted weight's backup, held
    steps = []
    tokenizer = bench_tokenizer(config.vocab_size)
    requests = Requests(tokenizer)
    with running_engine(parts, tokenizer, worker.max_lora_rank, True, on_step=steps.append) as engine:
        serve(engine, [requests.make(adapter.ref, 64, 32) for _ in range(4)])
    merged = [step.merged_adapter for step in steps]
    assert adapter.ref.name in merged and merged[-1] == adapter.ref.name, merged
