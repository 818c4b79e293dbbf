"""The LoRA ops on adapters packed at their true sizes in one arena: ranks 8, 16 and 64 in one batch,
a rank and a scaling of its own on each slice (PEFT's rank_pattern and alpha_pattern), adapters that
target a subset of the slices, and compactions between two forward calls.

The torch reference is checked against a float64 loop over the adapters' own weights; the Triton
kernels (interpreter), in float32 and float16, against the reference on a float32 copy of the stack,
on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from kernels import NO_SLOT, AdapterArena, LoRABatch, LoRAStack, reference
from kernels.lora_stack import packed_elems
from kernels.triton.lora_expand import lora_expand
from kernels.triton.lora_shrink import lora_shrink
from tests.unit.kernels.test_lora_triton import CONFIGS

IN_FEATURES, OUT_SIZES, MAX_RANK = 48, (64, 16, 32), 64  # a fused qkv-like projection
# slot -> (rank of each slice, 0: not targeted; scaling of each slice). Slot 4 stays empty.
ADAPTERS = {
    0: ((8, 8, 8), (0.5, 0.5, 0.5)),
    1: ((16, 16, 16), (2.0, 2.0, 2.0)),
    2: ((64, 64, 64), (0.125, 0.125, 0.125)),
    3: ((64, 0, 8), (0.25, 0.0, 4.0)),  # rank and alpha patterns, k untargeted
    5: ((0, 16, 0), (0.0, 1.5, 0.0)),   # k only
}
SEGMENTS = ((5, 1, 7, 2, 3, 1, 4, 6), (0, 1, 2, NO_SLOT, 3, 5, 4, 1))  # slot 1's tokens apart: gathered
Weights = dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]


def random_adapter(ranks: tuple[int, ...], dtype: torch.dtype, g: torch.Generator
                   ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {s: ((torch.randn(r, IN_FEATURES, generator=g) / IN_FEATURES ** 0.5).to(dtype),
                (torch.randn(OUT_SIZES[s], r, generator=g) / r ** 0.5).to(dtype)) for s, r in enumerate(ranks) if r}


def load(stack: LoRAStack, dtype: torch.dtype, seed: int) -> Weights:
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for slot, (ranks, scalings) in ADAPTERS.items():
        weights[slot] = random_adapter(ranks, dtype, g)
        stack.set_slot(slot, weights[slot], dict(enumerate(scalings)))
    return weights


def exact_arena() -> AdapterArena:
    """Just room for ADAPTERS."""
    return AdapterArena(sum(packed_elems(IN_FEATURES, OUT_SIZES, r) for r, _ in ADAPTERS.values()), torch.float32,
                        "cpu")


def inputs(batch: LoRABatch, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch.num_tokens, IN_FEATURES, generator=g).to(dtype),
            torch.randn(batch.num_tokens, sum(OUT_SIZES), generator=g).to(dtype))


def forward(backend: str, stack: LoRAStack, batch: LoRABatch, x: torch.Tensor, out: torch.Tensor,
            config: str = "default") -> torch.Tensor:
    """out + the LoRA delta, by the reference or the Triton kernels (with one of test_lora_triton's configs)."""
    out = out.clone()
    if backend == "reference":
        reference.lora_expand(out, reference.lora_shrink(x, stack, batch), stack, batch)
    else:
        shrink_cfg, expand_cfg, _, _ = CONFIGS[config]
        lora_expand(out, lora_shrink(x, stack, batch, shrink_cfg), stack, batch, expand_cfg)
    return out


def naive(x: torch.Tensor, out: torch.Tensor, weights: Weights, scalings: dict[int, tuple[float, ...]],
          batch: LoRABatch) -> torch.Tensor:
    """out + scaling_s * B_s A_s x, segment by segment, in float64 from the adapters' own weights."""
    expected = out.double().clone()
    offsets = (0, *torch.tensor(OUT_SIZES).cumsum(0).tolist())
    for start, length, slot in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots):
        for s, (a, b) in weights.get(slot, {}).items():
            rows = slice(start, start + length)
            expected[rows, offsets[s]:offsets[s + 1]] += scalings[slot][s] * (
                x[rows].double() @ a.double().t() @ b.double().t())
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_on_packed_adapters_matches_a_float64_loop(dtype):
    stack = LoRAStack.standalone(6, IN_FEATURES, OUT_SIZES, MAX_RANK, dtype, "cpu")
    weights = load(stack, dtype, seed=0)
    batch = LoRABatch.build(*SEGMENTS, "cpu")
    x, out = inputs(batch, dtype, seed=1)
    expected = naive(x, out, weights, {slot: scalings for slot, (_, scalings) in ADAPTERS.items()}, batch)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(forward("reference", stack, batch, x, out).double(), expected, rtol=tol,
                               atol=tol * expected.abs().max().item())


# Each config in the dtypes the main grid runs it in (test_lora_triton.CONFIGS): the interpreter's slow
# rank-split programs in float32 only.
PACKED_GRID = [(config, dtype) for config in ("default", "fma", "rank_blocks_split", "pipelined", "stationary")
               for dtype in CONFIGS[config][3]]


@pytest.mark.parametrize("config,dtype", PACKED_GRID, ids=[f"{c}-{str(d)[6:]}" for c, d in PACKED_GRID])
def test_triton_on_packed_adapters_matches_the_float32_reference(config, dtype):
    """Each expand kind (column steps in registers or pipelined, B-stationary) and shrink's K and rank splits."""
    stack = LoRAStack.standalone(6, IN_FEATURES, OUT_SIZES, MAX_RANK, dtype, "cpu")
    load(stack, dtype, seed=2)
    batch = LoRABatch.build(*SEGMENTS, "cpu", max_group_len=40 if CONFIGS[config][2] else None)
    x, out = inputs(batch, dtype, seed=3)
    expected = forward("reference", stack.copy(torch.float32, "cpu"), batch, x.float(), out.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(forward("triton", stack, batch, x, out, config).float(), expected, rtol=tol,
                               atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_an_explicit_compaction_between_two_forwards_changes_no_output(backend):
    """Slot 0's range (the first) freed: compacting moves every other adapter; set_slot's stacks follow."""
    stack = LoRAStack.empty(6, IN_FEATURES, OUT_SIZES, MAX_RANK, exact_arena())
    load(stack, torch.float32, seed=4)
    batch = LoRABatch.build([3, 4, 2, 5], [1, 2, 3, 5], "cpu")
    x, out = inputs(batch, torch.float32, seed=5)
    before = forward(backend, stack, batch, x, out)
    offsets = stack.b_offsets.clone()
    stack.reset_slot(0)
    assert stack.arena.compact()  # something moved
    assert not torch.equal(stack.b_offsets, offsets)
    assert torch.equal(forward(backend, stack, batch, x, out), before)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_set_slot_compacts_a_fragmented_arena_and_the_other_adapters_compute_the_same(backend):
    """Slots 0 and 5 freed leave two holes, each smaller than the next adapter, together larger:
    set_slot compacts (moving slots 1-3) and loads it; slots 1-3 compute what they did, and the
    new adapter what a float64 loop over its weights does."""
    stack = LoRAStack.empty(6, IN_FEATURES, OUT_SIZES, MAX_RANK, exact_arena())
    load(stack, torch.float32, seed=6)
    batch = LoRABatch.build([3, 4, 2], [1, 2, 3], "cpu")
    x, out = inputs(batch, torch.float32, seed=7)
    before = forward(backend, stack, batch, x, out)
    stack.reset_slot(0)
    stack.reset_slot(5)
    new_ranks = (16, 8, 0)
    need = stack.slot_elems(new_ranks)
    assert stack.arena.largest_free < need <= stack.arena.free_elems
    offsets = stack.host_a_offsets[1]
    new = random_adapter(new_ranks, torch.float32, torch.Generator().manual_seed(8))
    stack.set_slot(0, new, {0: 0.5, 1: 3.0})
    assert stack.host_a_offsets[1] != offsets and stack.arena.free_elems == stack.arena.largest_free
    assert torch.equal(forward(backend, stack, batch, x, out), before)

    only_new = LoRABatch.build([5], [0], "cpu")
    x, out = inputs(only_new, torch.float32, seed=9)
    expected = naive(x, out, {0: new}, {0: (0.5, 3.0, 0.0)}, only_new)
    torch.testing.assert_close(forward(backend, stack, only_new, x, out).double(), expected, rtol=1e-5, atol=1e-5)
