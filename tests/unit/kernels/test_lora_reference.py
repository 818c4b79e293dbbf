"""LoRABatch, LoRAStack and the torch reference ops against a naive per-token float64 loop.

The case grid and helpers here are shared with test_lora_triton.py, which checks the Triton
kernels against the reference on the same cases.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels import NO_SLOT, LoRABatch, LoRAStack, lora_expand, lora_shrink

IN_FEATURES = 40  # not a multiple of any block size
MAX_RANK = 16
LAYOUTS = {  # projection name -> out sizes of its slices
    "qkv": (48, 16, 16),
    "gate_up": (24, 24),
    "single": (20,),
}


@dataclass(frozen=True)
class AdapterSpec:
    ranks: tuple[int, ...]       # per slice, 0: not targeted (slices past a layout's are dropped)
    scalings: tuple[float, ...]  # per slice (PEFT's alpha_pattern); read where the rank is > 0


# Slot -> adapter; slot 3 stays empty. Mixed ranks, up to MAX_RANK; slot 1 targets q and v only,
# slot 2 only k (so in the single-slice layout it targets nothing); slot 4 has a rank and a
# scaling of its own on each slice (PEFT's rank_pattern and alpha_pattern).
ADAPTERS = {0: AdapterSpec((4, 4, 4), (2.0, 2.0, 2.0)), 1: AdapterSpec((8, 0, 8), (0.5, 0.0, 0.5)),
            2: AdapterSpec((0, 16, 0), (0.0, 1.25, 0.0)), 4: AdapterSpec((8, 2, 16), (-0.75, 1.5, 0.25))}
NUM_SLOTS = 5

CASES = {  # name -> (seg_lens, seg_slots, capacity)
    "mixed": ((5, 1, 3, 1, 4), (0, NO_SLOT, 2, 1, 4), None),
    "empty_segments": ((3, 0, 4, 0), (1, 0, 2, 2), None),
    "single_tokens": ((1, 1, 1, 1, 1), (0, 1, 2, NO_SLOT, 4), None),
    "base_only_and_empty_slot": ((4, 3, 2), (NO_SLOT, 3, 1), None),
    "empty_slot_only": ((3,), (3,), None),
    "no_lora": ((7,), (NO_SLOT,), None),
    "long_segments": ((37, 2, 19), (1, 0, 4), None),  # several M-tiles, ragged ends
    "padded_capacity": ((2, 3), (0, 1), 6),  # as a CUDA graph's batch: 4 padded groups
    # One adapter's tokens scattered over the batch: the kernels gather them through a row order.
    "interleaved": ((3, 2, 4, 1, 5, 2, 19), (0, 1, 0, NO_SLOT, 1, 4, 0), None),
    "scattered_tokens": ((1,) * 10, (0, 1, 0, 1, 4, NO_SLOT, 0, 4, 1, 0), None),
}


def random_weights(ranks: dict[int, int], out_sizes: tuple[int, ...], dtype: torch.dtype,
                   g: torch.Generator) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{slice: (A [r, in], B [out_s, r])} for the slices of rank r > 0; unit-variance products."""
    return {s: ((torch.randn(r, IN_FEATURES, generator=g) / IN_FEATURES ** 0.5).to(dtype),
                torch.randn(out_sizes[s], r, generator=g).to(dtype)) for s, r in ranks.items() if r}


def make_stack(layout: str, dtype: torch.dtype, seed: int = 0):
    """A stack holding ADAPTERS, plus their weights: {slot: {slice: (A [r, in], B [out_s, r])}}."""
    out_sizes = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    stack = LoRAStack.standalone(NUM_SLOTS, IN_FEATURES, out_sizes, MAX_RANK, dtype, "cpu")
    weights = {}
    for slot, spec in ADAPTERS.items():
        weights[slot] = random_weights(dict(enumerate(spec.ranks[:len(out_sizes)])), out_sizes, dtype, g)
        stack.set_slot(slot, weights[slot], dict(enumerate(spec.scalings)))
    return stack, weights


def poison_unused_storage(stack: LoRAStack) -> None:
    """NaN in every arena element an op must not read: all but the A_s and B_sᵀ blocks of the
    slots' targeted slices (alignment gaps, free space)."""
    live = torch.zeros(stack.arena.capacity, dtype=torch.bool)
    for slot in range(stack.num_slots):
        for s, rank in enumerate(stack.host_ranks[slot]):
            a, b = stack.host_a_offsets[slot][s], stack.host_b_offsets[slot][s]
            live[a:a + rank * stack.in_features] = True
            live[b:b + rank * stack.out_sizes[s]] = True
    stack.arena.data[~live] = float("nan")


def make_batch(case: str, device: str = "cpu", loose_bound: bool = False) -> LoRABatch:
    """loose_bound: max_group_len well above the largest group, as for a captured CUDA graph."""
    seg_lens, seg_slots, capacity = CASES[case]
    return LoRABatch.build(seg_lens, seg_slots, device, capacity, sum(seg_lens) + 64 if loose_bound else None)


def make_inputs(batch: LoRABatch, out_features: int, dtype: torch.dtype, seed: int = 1):
    """x [num_tokens, IN_FEATURES] and the base output [num_tokens, out_features]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch.num_tokens, IN_FEATURES, generator=g).to(dtype)
    out = torch.randn(batch.num_tokens, out_features, generator=g).to(dtype)
    return x, out


def lora_masks(stack: LoRAStack, batch: LoRABatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the ops must write: y entries [num_tokens, num_slices, max_rank] and out entries
    [num_tokens, out_features] of tokens whose slot's adapter targets the slice."""
    y_mask = torch.zeros(batch.num_tokens, stack.num_slices, stack.max_rank, dtype=torch.bool)
    out_mask = torch.zeros(batch.num_tokens, stack.out_features, dtype=torch.bool)
    for start, length, slot in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots):
        if slot == NO_SLOT:
            continue
        for s, rank in enumerate(stack.host_ranks[slot]):
            if rank > 0:
                y_mask[start:start + length, s, :rank] = True
                out_mask[start:start + length, stack.out_offsets[s]:stack.out_offsets[s + 1]] = True
    return y_mask, out_mask


def naive(x: torch.Tensor, out: torch.Tensor, weights, stack: LoRAStack, batch: LoRABatch) -> torch.Tensor:
    """out + scaling * B A x, token by token and slice by slice, in float64, from the adapters'
    own weights (not the stack's storage)."""
    expected = out.double().clone()
    for start, length, slot in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots):
        for t in range(start, start + length):
            for s, (a, b) in weights.get(slot, {}).items():
                cols = slice(stack.out_offsets[s], stack.out_offsets[s + 1])
                expected[t, cols] += ADAPTERS[slot].scalings[s] * (b.double() @ (a.double() @ x[t].double()))
    return expected


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_matches_naive_loop(case, layout, dtype):
    stack, weights = make_stack(layout, dtype)
    poison_unused_storage(stack)
    batch = make_batch(case)
    x, out = make_inputs(batch, stack.out_features, dtype)
    expected = naive(x, out, weights, stack, batch)
    _, out_mask = lora_masks(stack, batch)
    untouched = out.clone()

    y = lora_shrink(x, stack, batch)
    assert y.dtype == torch.float32 and y.shape == (1, batch.num_tokens, stack.num_slices, MAX_RANK)
    lora_expand(out, y, stack, batch)

    tol = tolerance(dtype)
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * scale)
    assert torch.equal(out[~out_mask], untouched[~out_mask])


def test_no_lora_exits_early_and_leaves_output_untouched():
    stack, _ = make_stack("qkv", torch.float32)
    batch = LoRABatch.build([3, 0], [NO_SLOT, 0], "cpu")  # a slot but no tokens: still no LoRA
    assert not batch.has_lora
    y = lora_shrink(torch.randn(3, IN_FEATURES), stack, batch)
    assert torch.equal(y, torch.zeros(1, 3, 3, MAX_RANK))
    out = torch.ones(3, stack.out_features)
    lora_expand(out, y, stack, batch)
    assert torch.equal(out, torch.ones(3, stack.out_features))


def test_shape_mismatches_are_rejected():
    stack, _ = make_stack("qkv", torch.float32)
    batch = LoRABatch.build([2], [0], "cpu")
    with pytest.raises(AssertionError):
        lora_shrink(torch.randn(3, IN_FEATURES), stack, batch)  # wrong token count
    with pytest.raises(AssertionError):
        lora_shrink(torch.randn(2, IN_FEATURES + 1), stack, batch)
    with pytest.raises(AssertionError):
        lora_expand(torch.zeros(2, stack.out_features), torch.zeros(2, 3, MAX_RANK, dtype=torch.float16), stack, batch)


def test_batch_build_groups_segments_by_slot_and_pads():
    batch = LoRABatch.build([5, 1, 0, 2], [2, NO_SLOT, 0, 1], "cpu", capacity=6)
    assert batch.num_tokens == 8 and batch.max_group_len == 5 and batch.capacity == 6
    assert batch.seg_starts == (0, 5, 6, 6)
    # Groups: slot 2 at 0..4, slot 1 at 6..7; NO_SLOT and empty segments are not groups.
    assert batch.rows is None
    assert batch.starts.tolist() == [0, 6, 8, 8, 8, 8]
    assert batch.lens.tolist() == [5, 2, 0, 0, 0, 0]
    assert batch.slots.tolist() == [2, 1, NO_SLOT, NO_SLOT, NO_SLOT, NO_SLOT]
    assert batch.has_lora
    assert LoRABatch.build([4], [NO_SLOT], "cpu").has_lora is False
    with pytest.raises(AssertionError):
        LoRABatch.build([4, 4], [0, 1], "cpu", capacity=1)
    with pytest.raises(AssertionError):
        LoRABatch.build([4, 4], [0, 1], "cpu", max_group_len=3)


def test_batch_build_gathers_a_slot_whose_tokens_are_scattered():
    batch = LoRABatch.build([2, 3, 1, 2], [0, 1, NO_SLOT, 0], "cpu")
    assert batch.rows.tolist() == [0, 1, 6, 7, 2, 3, 4]  # slot 0's tokens, then slot 1's
    assert batch.starts.tolist() == [0, 4] and batch.lens.tolist() == [4, 3]
    assert batch.slots.tolist() == [0, 1] and batch.max_group_len == 4
    with pytest.raises(AssertionError):  # the group of slot 0 has 4 tokens
        LoRABatch.build([2, 3, 1, 2], [0, 1, NO_SLOT, 0], "cpu", max_group_len=3)
    # Adjacent segments of one slot are one contiguous group: no row order needed.
    assert LoRABatch.build([2, 3, 1], [0, 0, NO_SLOT], "cpu").rows is None


def test_batch_copy_into_replaces_device_contents_and_clears_padding():
    static = LoRABatch.build([4, 4, 4], [0, 1, 2], "cpu", capacity=4, max_group_len=8)
    LoRABatch.build([3, 5], [4, NO_SLOT], "cpu").copy_into(static)
    assert static.starts[:1].tolist() == [0]
    assert static.lens.tolist() == [3, 0, 0, 0]
    assert static.slots.tolist() == [4, NO_SLOT, NO_SLOT, NO_SLOT]
    with pytest.raises(AssertionError):  # a larger group than the static batch's bound
        LoRABatch.build([9], [0], "cpu").copy_into(static)
    with pytest.raises(AssertionError):  # graphs replay batches grouped in token order only
        LoRABatch.build([1, 1, 1], [0, 1, 0], "cpu").copy_into(static)
