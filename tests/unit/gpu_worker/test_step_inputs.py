"""Step inputs: the LoRA segments and the rank summary the kernels' tile lookup reads."""

from __future__ import annotations

from gpu_worker.scheduler import ScheduledSeq
from gpu_worker.sequence import SamplingParams, Sequence
from gpu_worker.step_inputs import build_step_inputs
from kernels import NO_SLOT


def _seq(slot: int, rank: int, prompt_len: int) -> Sequence:
    seq = Sequence(f"r{slot}-{rank}", list(range(1, prompt_len + 1)), SamplingParams(), None, None)
    seq.slot, seq.rank = slot, rank  # as the engine sets them when it places the adapter
    seq.block_table = list(range(-(-prompt_len // 16)))  # as the block manager would: blocks of 16
    return seq


def test_segments_by_slot_and_the_rank_summary_over_adapter_tokens():
    items = [ScheduledSeq(_seq(2, 8, 30), 30, True), ScheduledSeq(_seq(NO_SLOT, 0, 50), 50, True),
             ScheduledSeq(_seq(0, 128, 10), 10, True), ScheduledSeq(_seq(2, 8, 20), 20, True)]
    inputs = build_step_inputs(items, block_size=16)
    assert inputs.seg_slots == [NO_SLOT, 0, 2] and inputs.seg_lens == [50, 10, 50]  # sorted by slot
    assert inputs.max_lora_rank == 128
    assert inputs.mean_lora_rank == (10 * 128 + 50 * 8) / 60  # base-only tokens do not count


def test_a_step_without_adapters_has_no_mean_rank():
    inputs = build_step_inputs([ScheduledSeq(_seq(NO_SLOT, 0, 7), 7, True)], block_size=16)
    assert inputs.max_lora_rank == 0 and inputs.mean_lora_rank is None
