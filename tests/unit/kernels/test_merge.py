"""All-layer merge (Triton in the interpreter, and the torch reference) against float64 W + s·B·A,
over several projections of different shapes in one launch; restore is bit-exact."""

from __future__ import annotations

import pytest
import torch

from kernels.lora_stack import LoRAStack
from kernels.merge import MergeTarget, merge_weights_reference, restore_weights
from kernels.triton_merge import merge_weights_triton, restore_weights_triton

PROJECTIONS = [(40, (48, 16, 16)), (40, (40,)), (70, (24, 24))]  # (in_features, out slice sizes): qkv, o, gate_up-like
SLOT, MAX_RANK = 1, 16


def _targets(dtype: torch.dtype, seed: int = 0) -> list[MergeTarget]:
    g = torch.Generator().manual_seed(seed)
    targets = []
    for i, (in_features, sizes) in enumerate(PROJECTIONS):
        stack = LoRAStack.empty(3, in_features, sizes, MAX_RANK, dtype, "cpu")
        rank = (4, 8, 16)[i]
        slices = {s: (torch.randn(rank, in_features, generator=g).to(dtype),
                      torch.randn(n, rank, generator=g).to(dtype)) for s, n in enumerate(sizes) if s != 1}
        stack.set_slot(SLOT, slices, scaling=0.5 + i)  # slice 1 untargeted: saved, left as it is
        weight = torch.randn(sum(sizes), in_features, generator=g).to(dtype)
        targets.append(MergeTarget(weight, torch.full_like(weight, float("nan")), stack))
    return targets


def _expected(target: MergeTarget, original: torch.Tensor) -> torch.Tensor:
    stack, expected = target.stack, original.double().clone()
    for s, rank in enumerate(stack.host_ranks[SLOT]):
        rows = slice(stack.out_offsets[s], stack.out_offsets[s + 1])
        if rank:
            expected[rows] += stack.scalings[SLOT].double() * (stack.b[SLOT, rows, :rank].double()
                                                             @ stack.a[SLOT, s, :rank].double())
    return expected


@pytest.mark.parametrize("merge", [merge_weights_reference, merge_weights_triton], ids=["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_then_restore(merge, dtype):
    targets = _targets(dtype)
    originals = [t.weight.clone() for t in targets]
    merge(targets, SLOT)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for target, original in zip(targets, originals):
        assert torch.equal(target.backup, original)
        expected = _expected(target, original)
        torch.testing.assert_close(target.weight.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())
        if target.stack.num_slices > 1:  # slice 1 is untargeted
            untargeted = slice(target.stack.out_offsets[1], target.stack.out_offsets[2])
            assert torch.equal(target.weight[untargeted], original[untargeted])
    restore = restore_weights_triton if merge is merge_weights_triton else restore_weights
    restore(targets)
    for target, original in zip(targets, originals):
        assert torch.equal(target.weight, original)
