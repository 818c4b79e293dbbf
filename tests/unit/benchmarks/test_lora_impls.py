"""benchmarks/harness/lora_impls.py: kernel_bench's torch baselines against kernels.reference in float32
on its cases (the ATMM kernels are checked by kernel_bench's own gate, test_kernel_bench.py), and the
layouts they build."""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import lora_cases
from benchmarks.harness import lora_impls as impls
from kernels import LoRABatch, LoRAStack, reference

F32 = torch.float32
BASELINES = {"torch_loop": impls.TorchLoop, "gather_bmm": impls.GatherBmm}
LAYOUT_CASES = {  # name -> (ranks, adapters, tokens, layout)
    "decode_scattered": ("mixed", 4, 11, "decode"),
    "prefill_scattered": ("mixed", 5, 17, "prefill"),
    "prefill_one_adapter": ("u16", 1, 9, "prefill"),  # contiguous: slices, no gathers
    "decode_fewer_tokens_than_adapters": ("u64", 16, 3, "decode"),
}


@pytest.mark.parametrize("impl", sorted(BASELINES))
@pytest.mark.parametrize("layout", sorted(LAYOUT_CASES))
def test_baselines_equal_the_reference_in_float32(impl, layout):
    ranks, adapters, tokens, kind = LAYOUT_CASES[layout]
    case = lora_cases.make_case(48, ranks, adapters, tokens, kind)
    g = torch.Generator().manual_seed(3)
    stack = lora_cases.random_stack(case, 2, F32, "cpu", g)
    batch = lora_cases.copy_batch(case, 1, "cpu")  # the second copy's slots: slot offsets matter
    x, out = lora_cases.random_rows(1, case, F32, "cpu", g)[0], lora_cases.random_rows(1, case, F32, "cpu", g)[0]
    want_y = reference.lora_shrink(x, stack, batch)[0, :, 0]  # [tokens, max_rank], zero past each rank
    want_out = out.clone()
    reference.lora_expand(want_out, want_y[None, :, None], stack, batch)

    op = BASELINES[impl](stack, batch)
    y = op.shrink(x)
    torch.testing.assert_close(op.dense(y), want_y, rtol=1e-5, atol=1e-5)
    op.expand(out, y)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)


def test_torch_loop_uses_views_for_contiguous_tokens_and_indices_otherwise():
    case = lora_cases.Case(hidden=16, ranks="u16", adapters=2, layout="prefill", seg_lens=(2, 3, 1), seg_adapters=(0, 1, 0))
    stack = lora_cases.random_stack(case, 1, F32, "cpu", torch.Generator().manual_seed(0))
    groups = impls.TorchLoop(stack, lora_cases.copy_batch(case, 0, "cpu")).groups
    assert groups[0][0].tolist() == [0, 1, 5] and groups[1][0] == slice(2, 5)


def test_gather_bmm_pads_groups_as_documented():
    stack = LoRAStack.standalone(8, 16, (16,), 16, F32, "cpu")
    for slot, rank in ((7, 4), (3, 8)):
        stack.set_slot(slot, {0: (torch.ones(rank, 16), torch.ones(16, rank))}, 1.0)
    op = impls.GatherBmm(stack, LoRABatch.build([1, 1, 1, 2, 1], [7, 3, 7, 0, 7], "cpu"))
    # Slot 0 is empty but still a group: tokens [3, 4], like slot 7's [0, 2, 5] and slot 3's [1].
    assert op.slots.tolist() == [7, 3, 0] and op.rank == 8
    assert op.idx_pad.tolist() == [[0, 2, 5], [1, 0, 0], [3, 4, 0]]
    assert op.valid.tolist() == [0, 1, 2, 3, 6, 7] and op.rows.tolist() == [0, 2, 5, 1, 3, 4]
