"""Triton LoRA kernels (CPU interpreter, see conftest.py) against the torch reference.

Same case grid as test_lora_reference.py. Arena elements outside the adapters' blocks are NaN
(reading them would show), y entries expand must not read (past the batch's rank tile, or of
untargeted slices) are NaN, and out entries expand must not touch are -0.0: a kernel that reads and
writes back even an unchanged value turns them into +0.0.
"""

from __future__ import annotations

import pytest
import torch

from kernels import NO_SLOT, LoRABatch, LoRAStack, reference, tiling
from kernels.tiling import ExpandConfig, ShrinkConfig
from kernels.triton import lora_common
from kernels.triton import lora_expand as triton_expand
from kernels.triton.lora_expand import lora_expand
from kernels.triton.lora_shrink import lora_shrink, y_dtype
from tests.unit.kernels.test_lora_reference import (CASES, IN_FEATURES, LAYOUTS, lora_masks, make_batch,
                                                    make_inputs, make_stack, poison_unused_storage, tolerance)

F32, F16 = torch.float32, torch.float16
CONFIGS = {  # name -> (shrink config, expand config, loose max_group_len bound, dtypes); None: lookup
    "default": (None, None, False, (F32, F16)),
    "default_loose": (None, None, True, (F32,)),  # programs search their tile (groups may span tiles)
    # K = 40 in 4 splits of 16: the last split's range is empty.
    "split_k_loose": (ShrinkConfig(block_m=16, block_k=16, split_k=4, num_warps=4, num_stages=2),
                      ExpandConfig(block_m=16, block_n=16, n_steps=3, num_warps=4, num_stages=2), True, (F32,)),
    "fma": (ShrinkConfig(block_m=4, block_k=16, split_k=2, num_warps=4, num_stages=2),  # < 16 rows: no tl.dot
            ExpandConfig(block_m=4, block_n=16, n_steps=2, num_warps=4, num_stages=2), False, (F16,)),
    # Ranks split over programs (those past an adapter's rank exit), with and without K splits. One token a
    # program makes this the interpreter's slowest grid (half the file's time in both dtypes): float32 here;
    # float16 loads and stores are the other configs', and the GPU suite runs every tuned config in bf16.
    "rank_blocks": (ShrinkConfig(block_m=1, block_k=16, split_k=1, num_warps=4, num_stages=2, rank_block=4),
                    ExpandConfig(block_m=1, block_n=16, n_steps=2, num_warps=4, num_stages=2), False, (F32,)),
    "rank_blocks_split": (ShrinkConfig(block_m=4, block_k=32, split_k=2, num_warps=4, num_stages=2, rank_block=8),
                          None, True, (F32,)),
    # Out tiles loaded in the column loop, prefetched by the compiler (3 columns steps; groups span tiles).
    "pipelined": (None, ExpandConfig(block_m=16, block_n=16, n_steps=3, num_warps=4, num_stages=3, pipeline=True),
                  True, (F32, F16)),
    "wide": (ShrinkConfig(block_m=32, block_k=32, split_k=1, num_warps=4, num_stages=2),
             ExpandConfig(block_m=32, block_n=32, n_steps=1, num_warps=4, num_stages=2), False, (F32,)),
    # B-stationary: 2 M-tiles of 16 rows a program, so a 37-token group takes two programs, the second
    # one partial; y as 2 float32 planes, then as one plane in the model's dtype.
    "stationary": (ShrinkConfig(block_m=16, block_k=16, split_k=2, num_warps=4, num_stages=2),
                   ExpandConfig(block_m=16, block_n=16, n_steps=1, num_warps=4, num_stages=3, m_steps=2), True, (F32,)),
    "stationary_one_plane": (ShrinkConfig(block_m=16, block_k=32, split_k=1, num_warps=4, num_stages=2),
                             ExpandConfig(block_m=16, block_n=32, n_steps=1, num_warps=4, num_stages=2, m_steps=2),
                             False, (F32, F16)),
}
GRID = [(config, dtype) for config, (*_, dtypes) in CONFIGS.items() for dtype in dtypes]
# rank_blocks runs a program per token: its long cases (58 and 36 tokens) cost a third of this file's time
# under the interpreter and exercise nothing the short ones do not (its rank exit is per program).
LONG_FOR_ONE_TOKEN_PROGRAMS = {"long_segments", "interleaved"}
CASE_GRID = [(config, dtype, case) for config, dtype in GRID for case in sorted(CASES)
             if not (config == "rank_blocks" and case in LONG_FOR_ONE_TOKEN_PROGRAMS)]


def run_and_check(stack, batch, x, out, shrink_cfg=None, expand_cfg=None) -> None:
    """Triton shrink + expand on poisoned buffers vs the reference on clean ones."""
    poison_unused_storage(stack)
    y_mask, out_mask = lora_masks(stack, batch)
    y_ref = reference.lora_shrink(x, stack, batch)
    out_ref = out.clone()
    reference.lora_expand(out_ref, y_ref, stack, batch)
    tol = tolerance(x.dtype)

    y = lora_shrink(x, stack, batch, shrink_cfg)
    splits = shrink_cfg.split_k if shrink_cfg else y.shape[0]
    assert y.dtype == y_dtype(splits, x.dtype) and y.shape == (splits, *y_ref.shape[1:])
    torch.testing.assert_close(y.float().sum(0)[y_mask], y_ref[0][y_mask], rtol=tol, atol=tol)

    # Past each adapter's rank, up to the batch's rank tile, y is zero (B-stationary expands read it unmasked).
    rank_tile = y_mask.any(-1, keepdim=True) & (torch.arange(stack.max_rank) < lora_common.rank_tile(stack, batch))
    assert torch.equal(y[:, rank_tile & ~y_mask], torch.zeros_like(y[:, rank_tile & ~y_mask]))
    y_poisoned = torch.where(rank_tile, y, float("nan"))  # every plane
    out = torch.where(out_mask, out, -0.0)
    lora_expand(out, y_poisoned, stack, batch, expand_cfg)
    scale = max(out_ref.abs().max().item(), 1.0) if out_ref.numel() else 1.0
    torch.testing.assert_close(out[out_mask].double(), out_ref[out_mask].double(), rtol=tol, atol=tol * scale)
    untouched = out[~out_mask]
    assert torch.equal(untouched, torch.zeros_like(untouched)) and untouched.signbit().all(), "expand wrote outside"


@pytest.mark.parametrize("config,dtype,case", CASE_GRID, ids=[f"{k}-{c}-{str(d)[6:]}" for c, d, k in CASE_GRID])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_triton_matches_reference(config, dtype, case, layout):
    shrink_cfg, expand_cfg, loose_bound, _ = CONFIGS[config]
    stack, _ = make_stack(layout, dtype)
    batch = make_batch(case, loose_bound=loose_bound)
    x, out = make_inputs(batch, stack.out_features, dtype)
    run_and_check(stack, batch, x, out, shrink_cfg, expand_cfg)


@pytest.mark.parametrize("config", ["split_k_loose", "fma", "wide"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_expand_without_the_early_b_tile_matches_reference(config, layout, monkeypatch: pytest.MonkeyPatch):
    """Tiles past PREFETCH_B_MAX_TILE read every B tile in the column loop; the test shapes are
    below it, so the bound is lowered to run that path."""
    monkeypatch.setattr(triton_expand, "PREFETCH_B_MAX_TILE", 0)
    shrink_cfg, expand_cfg, loose_bound, dtypes = CONFIGS[config]
    stack, _ = make_stack(layout, dtypes[0])
    batch = make_batch("mixed", loose_bound=loose_bound)
    x, out = make_inputs(batch, stack.out_features, dtypes[0])
    run_and_check(stack, batch, x, out, shrink_cfg, expand_cfg)


@pytest.mark.parametrize("config", ["default", "rank_blocks"])
def test_a_batch_rank_bound_tiles_only_the_ranks_it_uses(config):
    """Rank-8 and rank-16 adapters in a stack serving ranks up to 64: a batch of them built with max_rank 16
    is tuned and tiled as rank 16 (not 64), and still matches the reference."""
    shrink_cfg, expand_cfg, _, _ = CONFIGS[config]
    g = torch.Generator().manual_seed(3)
    stack = LoRAStack.standalone(3, IN_FEATURES, LAYOUTS["qkv"], 64, torch.float32, "cpu")
    for slot, rank in ((0, 8), (2, 16)):
        stack.set_slot(slot, {s: (torch.randn(rank, IN_FEATURES, generator=g), torch.randn(n, rank, generator=g))
                              for s, n in enumerate(LAYOUTS["qkv"])}, scaling=0.5)
    batch = LoRABatch.build([3, 2, 4], [0, NO_SLOT, 2], "cpu", max_rank=16)
    unbounded = LoRABatch.build([3, 2, 4], [0, NO_SLOT, 2], "cpu")
    assert tiling.bucket_of("shrink", stack, batch).block_r == 16
    assert tiling.bucket_of("shrink", stack, unbounded).block_r == 64
    x, out = make_inputs(batch, stack.out_features, torch.float32)
    run_and_check(stack, batch, x, out, shrink_cfg, expand_cfg)


# A rank-64 stack of ranks 5, 20, 33 and 64 (slot 2 empty), and a batch interleaving their tokens.
RANK_CLASS_BATCH = ([6, 17, 3, 20, 5, 9], [0, 1, 3, 4, NO_SLOT, 0])


def rank_class_stack(dtype: torch.dtype) -> LoRAStack:
    g = torch.Generator().manual_seed(4)
    stack = LoRAStack.standalone(5, IN_FEATURES, LAYOUTS["qkv"], 64, dtype, "cpu")
    for slot, rank in ((0, 5), (1, 20), (3, 33), (4, 64)):
        stack.set_slot(slot, {s: ((torch.randn(rank, IN_FEATURES, generator=g) / IN_FEATURES ** 0.5).to(dtype),
                                  torch.randn(n, rank, generator=g).to(dtype))
                              for s, n in enumerate(LAYOUTS["qkv"])}, scaling=0.5)
    return stack


@pytest.mark.parametrize("config", ["pipelined", "stationary_one_plane"])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_expand_steps_multiply_each_adapters_rank_class(config, dtype):
    """Pipelined and B-stationary steps multiply each adapter's narrowest rank tile (16, 32, 64 and 64 for
    ranks 5, 20, 33 and 64), with the arena around their blocks NaN-poisoned."""
    stack = rank_class_stack(dtype)
    batch = LoRABatch.build(*RANK_CLASS_BATCH, "cpu")
    x, out = make_inputs(batch, stack.out_features, dtype)
    run_and_check(stack, batch, x, out, None, CONFIGS[config][1])


def test_expand_adds_into_a_wider_output_dtype():
    """out in float32 while the weights are float16 (the base layer may keep a wider output)."""
    stack, _ = make_stack("qkv", torch.float16)
    batch = make_batch("mixed")
    x, _ = make_inputs(batch, stack.out_features, torch.float16)
    _, out = make_inputs(batch, stack.out_features, torch.float32)
    run_and_check(stack, batch, x, out)


def test_replay_reads_only_device_contents():
    """As in a CUDA graph: the kernels run on a static batch whose device tensors were overwritten
    by another batch's; its host tuples are stale and must not matter."""
    stack, _ = make_stack("qkv", torch.float32)
    static = LoRABatch.build([1] * 6, [NO_SLOT] * 6, "cpu", capacity=8, max_group_len=4)
    live = LoRABatch.build([4, 1, 1], [1, NO_SLOT, 0], "cpu")
    live.copy_into(static)
    x, out = make_inputs(static, stack.out_features, torch.float32)
    x[live.num_tokens:] = float("nan")  # rows past the live batch: padding nobody may read

    out_ref = out.clone()
    y_ref = reference.lora_shrink(x[:live.num_tokens], stack, live)
    reference.lora_expand(out_ref[:live.num_tokens], y_ref, stack, live)

    y = lora_shrink(x, stack, static)
    lora_expand(out, y, stack, static)
    torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-4)


def test_mismatched_dtypes_are_rejected():
    stack, _ = make_stack("single", torch.float16)
    batch = make_batch("mixed")
    x, _ = make_inputs(batch, stack.out_features, torch.float32)
    with pytest.raises(AssertionError):
        lora_shrink(x, stack, batch)
