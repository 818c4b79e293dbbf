"""The model shapes and LoRA targets the suites run. Random weights of a real model's shape stand in
for its checkpoint (the time of a step depends on the shapes, not the values); the tiny shapes are the
CPU smoke runs'."""

from __future__ import annotations

from gpu_worker.models.llama import LORA_TARGETS
from services.demo_assets import LlamaShape

LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5)
# Its vocabulary holds the bench tokenizer (4096 words) with room for the padding tokens.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=4096 + 2048, max_position_embeddings=1024, rms_norm_eps=1e-5)
_demo = LlamaShape()
DEMO_LLAMA = dict(hidden_size=_demo.hidden_size, intermediate_size=_demo.intermediate_size,
                  num_hidden_layers=_demo.num_layers, num_attention_heads=_demo.num_heads,
                  num_key_value_heads=_demo.num_kv_heads, max_position_embeddings=_demo.max_position_embeddings,
                  rms_norm_eps=1e-5)

QKV = ("q_proj", "k_proj", "v_proj")  # CaraServe's targets
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_SEVEN = tuple(LORA_TARGETS)
# The engine suites' adapters: rank RANK on q,k,v,o (a list, as WorkerConfig.lora_targets and the reports have it).
RANK = 64
TARGETS = list(QKVO)
