"""Mixture batches (deLoRA, kernels/batch.py): one adapter folded into the base weights, a mixture slot
pointing at it with negated scalings, and every group of another slot running that slot's ranks beside
its own in the same shrink and expand. The torch reference and the Triton kernels (CPU interpreter)
against a float64 loop over the adapters' own weights, in every expand program kind."""

from __future__ import annotations

import pytest
import torch

from kernels import NO_SLOT, LoRABatch, reference
from kernels.triton.lora_expand import lora_expand
from kernels.triton.lora_shrink import lora_shrink
from tests.unit.kernels.test_lora_reference import ADAPTERS, LAYOUTS, make_inputs, make_stack, tolerance
from tests.unit.kernels.test_lora_triton import CONFIGS

MERGED, MIX_SLOT = 4, 3  # slot 4's adapter is folded in; slot 3 (empty) mirrors it, negated
# Slot 0's and slot 1's tokens (slot 2 targets k only: nothing in the single layout), the merged adapter's
# (NO_SLOT: base-only on the merged weights) and the base model's (the mixture slot alone), interleaved.
SEG_LENS = (5, 2, 3, 4, 1, 19, 2)
SEG_SLOTS = (0, NO_SLOT, MIX_SLOT, 1, 2, 0, MIX_SLOT)


def expected(x, out, weights, stack) -> torch.Tensor:
    """out + each token's own adapter's delta minus the merged adapter's, in float64 (merged tokens: out)."""
    result = out.double().clone()
    start = 0
    for length, slot in zip(SEG_LENS, SEG_SLOTS):
        parts = [] if slot == NO_SLOT else [(MERGED, -1.0)] + ([(slot, 1.0)] if slot != MIX_SLOT else [])
        for t in range(start, start + length):
            for adapter, sign in parts:
                for s, (a, b) in weights.get(adapter, {}).items():
                    cols = slice(stack.out_offsets[s], stack.out_offsets[s + 1])
                    result[t, cols] += sign * ADAPTERS[adapter].scalings[s] * (b.double() @ (a.double() @ x[t].double()))
        start += length
    return result


@pytest.mark.parametrize("config", ["default", "fma", "rank_blocks_split", "pipelined", "stationary", "wide"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_mixture_batch_adds_each_adapter_and_subtracts_the_merged_one(config, layout):
    shrink_cfg, expand_cfg, loose_bound, dtypes = CONFIGS[config]
    dtype = dtypes[-1]
    stack, weights = make_stack(layout, dtype)
    stack.mirror(MERGED, MIX_SLOT, -1.0)
    batch = LoRABatch.build(SEG_LENS, SEG_SLOTS, "cpu", max_group_len=sum(SEG_LENS) + 64 if loose_bound else None,
                            mix_slot=MIX_SLOT)
    assert batch.rank_bound(stack.max_rank) == 2 * stack.max_rank  # a group runs two adapters' ranks
    x, out = make_inputs(batch, stack.out_features, dtype)
    want = expected(x, out, weights, stack)
    tol = tolerance(dtype)
    scale = max(want.abs().max().item(), 1.0)

    out_ref = out.clone()
    reference.lora_expand(out_ref, reference.lora_shrink(x, stack, batch), stack, batch)
    torch.testing.assert_close(out_ref.double(), want, rtol=tol, atol=tol * scale)

    y = lora_shrink(x, stack, batch, shrink_cfg)
    assert y.shape[-1] == 2 * stack.max_rank
    out_triton = out.clone()
    lora_expand(out_triton, y, stack, batch, expand_cfg)
    torch.testing.assert_close(out_triton.double(), want, rtol=tol, atol=tol * scale)
    merged_rows = slice(SEG_LENS[0], SEG_LENS[0] + SEG_LENS[1])
    assert torch.equal(out_triton[merged_rows], out[merged_rows])  # the merged adapter's tokens: untouched
