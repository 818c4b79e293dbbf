"""Runs one packed forward pass for a step and returns the next-token logits of the sequences
that sample. Decode-only steps on CUDA replay a captured graph when one fits the batch. Prefill
chunks over image tokens get the image features as their embeddings; each sequence's images go
through the image encoder once, at the first chunk that needs them, every such sequence of a step in
one encoder pass, each image through its adapter's tower LoRA if it has one (vision/tower_lora.py).
A step scheduled before the previous step's tokens reached the host (async scheduling) takes those of
its input ids from the device. A step runs in the mode the orchestrator planned (orchestrator.py):
merged, its adapter is folded into the base weights first and the step runs base-only; mixture, the
same weights, and every token of another adapter or of none also runs the merged adapter negated
(lora/merge_switch.py's mixture slot) in the same LoRA launches (kernels/batch.py), eager. Task-head
requests' hidden states at their head's positions are kept, and once a prompt has run, its adapter's
head answers from them (heads.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from gpu_worker.cuda_graphs import DecodeGraphs
from gpu_worker.forward_context import ForwardContext, LoraWaits, forward_context
from gpu_worker.heads import apply_head
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.lora.cpu_assist import CpuLoraPool, CpuLoraStep
from gpu_worker.lora.gpu_memory import AdapterCopy, copy_waits
from gpu_worker.lora.layer import LoRALinear
from gpu_worker.lora.loader import HeadWeights, TowerWeights
from gpu_worker.lora.merge_switch import MergeSwitch
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.orchestrator import InferenceMode, StepPlan
from gpu_worker.sampler import SampledTokens
from gpu_worker.scheduler import ScheduledSeq
from gpu_worker.sequence import Sequence
from gpu_worker.step_inputs import InFlightIds, StepInputs, build_step_inputs
from gpu_worker.vision.image_cache import BASE_TOWER, CachedImageEncoder, TowerAdapter
from kernels import NO_SLOT, LoRABatch
from kernels.attention import AttentionMetadata


class StepOutput(NamedTuple):
    sampling: list[Sequence]   # the sequences that sample, in logits' row order
    logits: torch.Tensor       # float32 [len(sampling), vocab]
    answers: list[tuple[Sequence, torch.Tensor]]  # head requests whose prompt ran: their head's answer (device)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: PagedKVCache, device: torch.device,
                 graphs: DecodeGraphs | None = None, merge_switch: MergeSwitch | None = None,
                 image_encoder: CachedImageEncoder | None = None, cpu_lora: CpuLoraPool | None = None,
                 lora_modules: Iterable[LoRALinear] = (),
                 heads: Callable[[int], HeadWeights | None] = lambda slot: None,
                 towers: Callable[[Sequence], TowerWeights | None] = lambda seq: None) -> None:
        """`cpu_lora`: the CPU LoRA workers; `lora_modules`: the projections in the order of a host
        copy's parts (GpuAdapterMemory's); `heads`: a GPU slot's task head, if its adapter has one;
        `towers`: a sequence's adapter's tower LoRA (on its GPU slot, or its host copy's) if it has one."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.graphs = graphs
        self.merge_switch = merge_switch
        self.image_encoder = image_encoder
        self.cpu_lora = cpu_lora
        self._heads = heads
        self._towers = towers
        self._module_index = {module: index for index, module in enumerate(lora_modules)}

    @property
    def merged_adapter(self) -> str | None:
        """The adapter folded into the base weights for the last step, if any."""
        return self.merge_switch.merged_adapter if self.merge_switch else None

    @torch.inference_mode()
    def run(self, items: list[ScheduledSeq], plan: StepPlan, previous: SampledTokens | None = None,
            copies: list[AdapterCopy] | tuple[()] = ()) -> StepOutput:
        """Run `items` in `plan`'s mode; -> the sequences that sample, their logits and the head answers.
        A sequence with a token in flight decodes it: its input id is its token in `previous`,
        still on the device. `copies`: adapters' copies onto the GPU still in flight, whose bytes each
        projection waits for on the device (eager: a captured graph cannot wait on them)."""
        inputs = build_step_inputs(items, self.kv_cache.block_size)
        merged = self._hold_weights(plan)
        mix_slot = NO_SLOT
        if plan.mode is InferenceMode.MIXTURE:
            # The merged adapter's tokens run base-only; every other token also runs the merged adapter
            # negated (the mixture slot), and the base model's tokens run that alone.
            mix_slot = self.merge_switch.mixture_slot
            inputs = dataclasses.replace(inputs, seg_slots=[
                NO_SLOT if slot == plan.merged_slot else mix_slot if slot == NO_SLOT else slot
                for slot in inputs.seg_slots])
        elif merged:
            inputs = dataclasses.replace(inputs, seg_slots=[NO_SLOT] * len(inputs.seg_slots))  # base-only
        in_flight = InFlightIds.of(inputs, previous.seqs, previous.tokens) if previous is not None else None
        assert in_flight is not None or not any(item.seq.num_in_flight for item in items)
        cpu_rows = self._cpu_rows(inputs)
        waits = copy_waits(copies) if copies and not merged else None
        if (cpu_rows is None and waits is None and mix_slot == NO_SLOT and self.graphs is not None
                and inputs.is_decode_only and self.graphs.fits(len(items))):
            logits, answers = self.graphs.replay(inputs, in_flight), []
        else:
            logits, answers = self._run_eager(inputs, in_flight, cpu_rows, waits, mix_slot, copies)
        for item in items:
            seq = item.seq
            seq.num_cached += item.num_new
            seq.kv_shareable &= not merged
            if seq.image_features is not None and seq.num_cached >= seq.images.end:
                seq.image_features = None
        return StepOutput(inputs.sampling, logits, answers)

    def _hold_weights(self, plan: StepPlan) -> bool:
        """Merge or restore the base weights as `plan` says; -> whether the step runs on merged weights."""
        if self.merge_switch is None:
            assert plan.mode is InferenceMode.UNMERGED, plan
            return False
        merged = plan.mode is not InferenceMode.UNMERGED
        return self.merge_switch.hold((plan.merged_slot, plan.merged_adapter) if merged else None)

    def _device_tensor(self, values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def close(self) -> None:
        if self.cpu_lora is not None:
            self.cpu_lora.close()

    def _cpu_rows(self, inputs: StepInputs) -> CpuLoraStep | None:
        """The step's CPU-assisted sequences (their packed rows and host copies), if any."""
        rows, row = [], 0
        for item in inputs.items:
            if item.seq.cpu_adapter is not None:
                rows.append((row, row + item.num_new, item.seq.cpu_adapter))
            row += item.num_new
        if not rows:
            return None
        assert self.cpu_lora is not None, "a CPU-assisted sequence without CPU LoRA workers"
        return CpuLoraStep(self.cpu_lora, self._module_index, rows)

    def _run_eager(self, inputs: StepInputs, in_flight: InFlightIds | None = None,
                   cpu_rows: CpuLoraStep | None = None, waits: LoraWaits | None = None,
                   mix_slot: int = NO_SLOT, copies: list[AdapterCopy] | tuple[()] = ()
                   ) -> tuple[torch.Tensor, list[tuple[Sequence, torch.Tensor]]]:
        width = max(len(table) for table in inputs.block_tables)
        query_start_loc = [0]
        for n in inputs.query_lens:
            query_start_loc.append(query_start_loc[-1] + n)
        attention = AttentionMetadata(
            query_start_loc=self._device_tensor(query_start_loc, torch.int32),
            seq_lens=self._device_tensor(inputs.seq_lens, torch.int32),
            block_tables=self._device_tensor([t + [0] * (width - len(t)) for t in inputs.block_tables], torch.int32),
            slot_mapping=self._device_tensor(inputs.slot_mapping, torch.int64),
            max_query_len=max(inputs.query_lens), max_seq_len=max(inputs.seq_lens))
        mixture = mix_slot != NO_SLOT  # the batch's ranks: its adapters' and the merged one's beside them
        lora = LoRABatch.build(inputs.seg_lens, inputs.seg_slots, self.device,
                               max_rank=None if mixture else inputs.max_lora_rank,
                               mean_rank=None if mixture else inputs.mean_lora_rank, mix_slot=mix_slot)
        input_ids = self._device_tensor(inputs.input_ids, torch.long)
        if in_flight is not None:
            in_flight.write_into(input_ids)
        embeds = self._input_embeddings(inputs, input_ids, copies)
        with forward_context(ForwardContext(attention, self.kv_cache, lora, cpu_rows, waits)):
            hidden = self.model(input_ids, self._device_tensor(inputs.positions, torch.long), embeds)
        answers = self._answer_heads(inputs, hidden, copies) if inputs.head_rows else []
        return self.model.compute_logits(hidden[self._device_tensor(inputs.logit_rows, torch.long)]), answers

    def _answer_heads(self, inputs: StepInputs, hidden: torch.Tensor,
                      copies: list[AdapterCopy] | tuple[()]) -> list[tuple[Sequence, torch.Tensor]]:
        """Keep the head requests' hidden states at their head's positions; answer those whose prompt this
        step completes, the requests of one adapter in one call."""
        done: dict[int, list[Sequence]] = {}
        for part in inputs.head_rows:
            # Consecutive rows; a copy, so that a prompt chunked over steps does not hold on to whole steps.
            part.seq.head_hidden.append(hidden[part.rows[0]:part.rows[-1] + 1].clone())
            if part.completes:
                done.setdefault(part.seq.slot, []).append(part.seq)
        for copy in copies:  # a head lies at the end of its adapter's copy: the whole copy must be in
            torch.cuda.current_stream(self.device).wait_event(copy.done)
        answers = []
        for slot, seqs in done.items():
            weights = self._heads(slot)
            assert weights is not None, f"a head request on slot {slot}, whose adapter has no head"
            values = apply_head(weights, torch.stack([torch.cat(seq.head_hidden) for seq in seqs]))
            answers += zip(seqs, values.unbind(0))
            for seq in seqs:
                seq.head_hidden.clear()
        return answers

    def _input_embeddings(self, inputs: StepInputs, input_ids: torch.Tensor,
                          copies: list[AdapterCopy] | tuple[()] = ()) -> torch.Tensor | None:
        """The step's token embeddings [num_tokens, hidden] with image features at image tokens;
        None when the step has no image token (the model embeds the ids itself)."""
        if not inputs.image_rows:
            return None
        assert self.image_encoder is not None, "image tokens without an image encoder"
        new = list({id(part.seq): part.seq for part in inputs.image_rows if part.seq.image_features is None}.values())
        if new:
            adapters = self._tower_adapters(new)
            if copies and any(adapter.tower is not None for adapter in adapters):
                for copy in copies:  # tower LoRA lies at the end of its adapter's copy: the whole copy must be in
                    torch.cuda.current_stream(self.device).wait_event(copy.done)
            encoded = self.image_encoder([(seq.images, adapter) for seq, adapter in zip(new, adapters)])
            for seq, features in zip(new, encoded):
                seq.image_features = features
        rows: list[int] = []
        features: list[torch.Tensor] = []
        for part in inputs.image_rows:
            seq = part.seq
            rows.extend(range(part.row, part.row + part.count))
            features.append(seq.image_features[part.feature:part.feature + part.count])
        embeds = self.model.embed(input_ids)
        embeds[self._device_tensor(rows, torch.long)] = torch.cat(features).to(embeds.dtype)
        return embeds

    def _tower_adapters(self, seqs: list[Sequence]) -> list[TowerAdapter]:
        """Each sequence's tower LoRA, one TowerWeights per adapter version (the encoder keeps their images together)."""
        by_digest: dict[str, TowerAdapter] = {}
        adapters = []
        for seq in seqs:
            if seq.adapter is None or not seq.adapter.tower_lora_params:
                adapters.append(BASE_TOWER)
                continue
            digest = seq.adapter.sha256
            if digest not in by_digest:
                tower = self._towers(seq)
                assert tower is not None, f"adapter {seq.adapter.name} has tower LoRA, none is loaded"
                by_digest[digest] = TowerAdapter(digest, tower)
            adapters.append(by_digest[digest])
        return adapters
