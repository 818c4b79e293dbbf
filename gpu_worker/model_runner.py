"""Runs one packed forward pass for the scheduled sequences and returns their next-token logits."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from gpu_worker.forward_context import ForwardContext, SeqSlice, forward_context
from gpu_worker.kv_cache import KVCache
from gpu_worker.lora.batch_info import build_lora_batch_info
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device

    @torch.inference_mode()
    def run(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """Prefill and decode sequences together, packed -> float32 logits [len(seqs), vocab]."""
        # Build host lists first, then one copy per tensor.
        input_ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        for seq in seqs:
            new = seq.new_token_ids()
            slices.append(SeqSlice(seq.seq_id, len(input_ids), len(new), seq.num_cached))
            input_ids.extend(new)
            positions.extend(range(seq.num_cached, seq.num_cached + len(new)))
        lora = build_lora_batch_info([s.num_new for s in slices], [seq.slot for seq in seqs], [seq.rank for seq in seqs])
        context = ForwardContext(tuple(slices), self.kv_cache, lora)
        ids_t = torch.tensor(input_ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos_t = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
        with forward_context(context):
            hidden = self.model(ids_t, pos_t)  # [num_tokens, hidden]
        last = torch.tensor([s.token_start + s.num_new - 1 for s in slices], device=self.device)
        for seq, s in zip(seqs, slices):
            seq.num_cached += s.num_new
        return self.model.compute_logits(hidden[last])
