"""All-layer merge (Triton in the interpreter, and the torch reference) against float64 W + s·B·A,
over several projections of different shapes in one launch, their adapters packed in one arena with
a rank and a scaling of their own per slice; restore is bit-exact."""

from __future__ import annotations

import pytest
import torch

from kernels import AdapterArena, restore_weights
from kernels.lora_stack import LoRAStack, packed_elems
from kernels.merge import MergeTarget, merge_weights_reference
from kernels.triton.merge import MergeConfig, RestoreConfig, merge_weights_triton, restore_weights_triton

PROJECTIONS = [(40, (48, 16, 16)), (40, (40,)), (70, (24, 24))]  # (in_features, out slice sizes): qkv, o, gate_up-like
SLOT, MAX_RANK = 1, 16


def _targets(dtype: torch.dtype, seed: int = 0) -> list[MergeTarget]:
    """Every projection's stack in one arena (room for 3 max-rank adapters each), as in a worker."""
    g = torch.Generator().manual_seed(seed)
    arena = AdapterArena(3 * sum(packed_elems(k, sizes, [MAX_RANK] * len(sizes)) for k, sizes in PROJECTIONS),
                         dtype, "cpu")
    targets = []
    for i, (in_features, sizes) in enumerate(PROJECTIONS):
        stack = LoRAStack.empty(3, in_features, sizes, MAX_RANK, arena)
        ranks = ((4, 0, 2), (8,), (16, 0))[i]  # per slice (rank_pattern); slice 1 untargeted: saved, left as it is
        slices = {s: (torch.randn(rank, in_features, generator=g).to(dtype),
                      torch.randn(n, rank, generator=g).to(dtype)) for s, (n, rank) in enumerate(zip(sizes, ranks))
                  if rank}
        stack.set_slot(SLOT, slices, {s: 0.5 + i + s for s in slices})  # a scaling per slice (alpha_pattern)
        weight = torch.randn(sum(sizes), in_features, generator=g).to(dtype)
        targets.append(MergeTarget(weight, torch.full_like(weight, float("nan")), stack))
    return targets


def _expected(target: MergeTarget, original: torch.Tensor, slot: int = SLOT) -> torch.Tensor:
    """From the adapter's weights as set_slot took them (A [r, in], B [out_s, r]) and its host scalings."""
    stack, expected = target.stack, original.double().clone()
    for s, (a, b) in stack.slot_weights(slot).items():
        rows = slice(stack.out_offsets[s], stack.out_offsets[s + 1])
        expected[rows] += stack.host_scalings[slot][s] * (b.double() @ a.double())
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


def _gqa_targets(dtype: torch.dtype, max_rank: int, rank: int) -> list[MergeTarget]:
    """A GQA-like fused qkv (q 70 rows, k and v 9: no size a multiple of a tile, k untargeted),
    an o the adapter does not target at all (every slice rank 0), and a wide down-like projection."""
    g = torch.Generator().manual_seed(1)
    targets = []
    for in_features, sizes, targeted in ((48, (70, 9, 9), (0, 2)), (48, (48,), ()), (100, (33,), (0,))):
        stack = LoRAStack.standalone(2, in_features, sizes, max_rank, dtype, "cpu")
        stack.set_slot(SLOT, {s: (torch.randn(rank, in_features, generator=g).to(dtype),
                                  torch.randn(sizes[s], rank, generator=g).to(dtype))
                              for s in targeted}, scaling=0.75)
        weight = torch.randn(sum(sizes), in_features, generator=g).to(dtype)
        targets.append(MergeTarget(weight, torch.full_like(weight, float("nan")), stack))
    return targets


@pytest.mark.parametrize("config", [None, MergeConfig(block_n=16, block_k=32, num_warps=1)], ids=["default", "16x32"])
@pytest.mark.parametrize("dtype,max_rank,rank",
                         [(torch.float16, 8, 4), (torch.float16, 32, 32), (torch.float32, 16, 9)])
def test_merge_gqa_slices_partial_tiles_and_rank_zero(config, dtype, max_rank, rank):
    """Slices of different sizes in one weight, rows and columns that end inside a tile, a rank below
    the stack's padding (B's stride) and below tl.dot's 16, and projections left as they are; the
    16-bit result is the float32 reference rounded once (at most one unit in the last place from it)."""
    targets, references = _gqa_targets(dtype, max_rank, rank), _gqa_targets(dtype, max_rank, rank)
    originals = [t.weight.clone() for t in targets]
    merge_weights_triton(targets, SLOT, config)
    merge_weights_reference(references, SLOT)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for target, reference_, original in zip(targets, references, originals):
        assert torch.equal(target.backup, original)
        actual, expected = target.weight.double(), reference_.weight.double()
        if dtype != torch.float32:  # both round a float32 sum once: at most one unit in the last place
            # apart, give or take the float32 sums' own differences where W + delta cancels to ~0
            ulp = torch.maximum(actual.abs(), expected.abs()) * torch.finfo(dtype).eps
            assert ((actual - expected).abs() <= ulp + 1e-5).all()
        exact = _expected(target, original)
        torch.testing.assert_close(actual, exact, rtol=tol, atol=tol * exact.abs().max().item())
        for s, slice_rank in enumerate(target.stack.host_ranks[SLOT]):
            rows = slice(target.stack.out_offsets[s], target.stack.out_offsets[s + 1])
            assert torch.equal(target.weight[rows], original[rows]) == (slice_rank == 0)
    restore_weights_triton(targets, RestoreConfig(block=128, num_warps=1))
    assert all(torch.equal(t.weight, o) for t, o in zip(targets, originals))


def test_same_targets_merge_any_slot_and_the_adapter_loaded_into_it_now():
    """The launch description is built once per set of targets: merging another slot, the same slot
    after a new adapter (another rank, other slices) was loaded into it, and after a compaction moved
    the adapters in the arena, uses what is there now."""
    targets = _targets(torch.float32)
    originals = [t.weight.clone() for t in targets]
    g = torch.Generator().manual_seed(7)

    def load(slot: int, rank: int, targeted: tuple[int, ...]) -> None:
        for t in targets:
            stack = t.stack
            sizes = [stack.out_offsets[s + 1] - stack.out_offsets[s] for s in range(stack.num_slices)]
            stack.set_slot(slot, {s: (torch.randn(rank, stack.in_features, generator=g),
                                      torch.randn(sizes[s], rank, generator=g))
                                  for s in targeted if s < stack.num_slices}, scaling=1.5)

    # (slot, adapter loaded into it first: (rank, targeted slices)); slot 1 as _targets left it, then others;
    # "compact": slot 0's adapter freed and the arena compacted, then slot 2 merged again
    steps = ((SLOT, None), (0, (3, (0,))), (2, (MAX_RANK, (0, 1))), (SLOT, (2, (1,))), (2, "compact"))
    for slot, adapter in steps:
        if adapter == "compact":
            for t in targets:
                t.stack.reset_slot(0)
            assert targets[0].stack.arena.compact()  # slots 2 and 1 moved down
        elif adapter is not None:
            load(slot, *adapter)
        merge_weights_triton(targets, slot)
        for target, original in zip(targets, originals):
            exact = _expected(target, original, slot)
            torch.testing.assert_close(target.weight.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
        restore_weights_triton(targets)
        assert all(torch.equal(t.weight, o) for t, o in zip(targets, originals))


@pytest.mark.parametrize("shape", [(3, 37), (16, 64)], ids=["odd", "aligned"])
def test_restore_copies_every_element_of_every_target(shape):
    """Chunks that end inside a target, targets of different sizes, one launch."""
    weights = [torch.randn(shape), torch.randn(shape[0] * 5, shape[1])]
    targets = [MergeTarget(torch.zeros_like(w), w,
                           LoRAStack.standalone(1, w.shape[1], (w.shape[0],), 1, w.dtype, "cpu")) for w in weights]
    restore_weights_triton(targets, RestoreConfig(block=128, num_warps=1))
    assert all(torch.equal(t.weight, t.backup) for t in targets)
