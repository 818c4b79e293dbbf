"""The skinny decode matmul (Triton interpreter on CPU) against torch in float64, with shapes that
are not multiples of any tile, with and without bias; the same kernel with a LoRA expand fused in;
and the dispatchers' choices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import LoRABatch, LoRAStack, linear_with_lora, reference
from kernels.linear import linear
from kernels.triton_linear import LinearConfig, LoRAOperand, fuses_lora, skinny_linear
from tests.unit.kernels.test_lora_reference import CASES as LORA_CASES
from tests.unit.kernels.test_lora_reference import (IN_FEATURES, lora_masks, make_batch, make_inputs, make_stack,
                                                    poison_unused_storage)

# (rows, in_features, out_features): each row tile (16, 32, 64), partly filled
SHAPES = [(1, 40, 24), (5, 100, 72), (16, 33, 130), (17, 64, 40), (33, 100, 72), (64, 40, 24)]
CONFIGS = [None, LinearConfig(block_n=16, block_k=16, num_warps=4, num_stages=2)]


@pytest.mark.parametrize("rows,in_features,out_features", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", CONFIGS, ids=["shape_heuristic", "small_tiles"])
def test_skinny_linear_matches_float64(rows, in_features, out_features, with_bias, dtype, config):
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=g) * 0.1).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype) if with_bias else None
    out = skinny_linear(x, weight, bias, config)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.dtype == dtype and out.shape == (rows, out_features)
    assert not out.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_cpu_and_wide_batches_use_torch():
    """The Triton path is only for CUDA, 16-bit, <= 64 rows; everything else is F.linear exactly."""
    x, weight = torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(linear(x, weight), F.linear(x, weight))


# The LoRA expand fused into the skinny matmul (kernels.linear_with_lora on CUDA), against the
# float64 matmul plus the torch reference expand, on the LoRA kernels' case grid.
FUSED_CONFIG = LinearConfig(block_n=16, block_k=16, num_warps=4, num_stages=2)  # 16 | the qkv slices


@pytest.mark.parametrize("case", sorted(LORA_CASES))
@pytest.mark.parametrize("layout", ["qkv", "single"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 2])
def test_fused_lora_matches_matmul_plus_reference_expand(case, layout, dtype, splits):
    stack, _ = make_stack(layout, dtype)
    poison_unused_storage(stack)
    batch = make_batch(case)
    x, _ = make_inputs(batch, stack.out_features, dtype)
    g = torch.Generator().manual_seed(7)
    weight = (torch.randn(stack.out_features, IN_FEATURES, generator=g) * 0.1).to(dtype)
    bias = torch.randn(stack.out_features, generator=g).to(dtype)
    y_mask, _ = lora_masks(stack, batch)
    y_ref = reference.lora_shrink(x, stack, batch)
    # Split planes as lora_shrink's K splits leave them; entries no op defines are NaN.
    planes = torch.cat([y_ref / splits] * splits)
    operand = LoRAOperand(torch.where(y_mask, planes, float("nan")), stack, batch)
    assert fuses_lora(stack, batch, FUSED_CONFIG)

    out = skinny_linear(x, weight, bias, FUSED_CONFIG, lora=operand)
    expected = F.linear(x.double(), weight.double(), bias.double())
    reference.lora_expand(expected, y_ref, stack, batch)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_tiles_straddling_slices_do_not_fuse():
    """gate_up's 24-column slices: no 16-column tile boundary falls on theirs."""
    stack, _ = make_stack("gate_up", torch.float32)
    batch = make_batch("mixed")
    assert not fuses_lora(stack, batch, FUSED_CONFIG)


def test_linear_with_lora_on_cpu_is_matmul_then_reference_expand():
    stack, _ = make_stack("qkv", torch.float32)
    batch = make_batch("mixed")
    x, _ = make_inputs(batch, stack.out_features, torch.float32)
    weight = torch.randn(stack.out_features, IN_FEATURES)
    expected = F.linear(x, weight)
    reference.lora_expand(expected, reference.lora_shrink(x, stack, batch), stack, batch)
    assert torch.equal(linear_with_lora(x, weight, None, stack, batch), expected)


def test_many_one_token_groups_run_the_expand_apart():
    """Each of 9+ rows on its own adapter: the fused kernel would visit every group in every program
    (MAX_FUSED_ONE_TOKEN_GROUPS); up to 8 such rows, or as many rows in longer groups, fuse."""
    from kernels.triton_linear import MAX_FUSED_ONE_TOKEN_GROUPS

    n = MAX_FUSED_ONE_TOKEN_GROUPS
    stack = LoRAStack.empty(n + 1, IN_FEATURES, (20,), 16, torch.float32, "cpu")

    def fused(seg_lens: list[int]) -> bool:
        return fuses_lora(stack, LoRABatch.build(seg_lens, list(range(len(seg_lens))), "cpu"), FUSED_CONFIG)

    assert fused([1] * n)
    assert not fused([1] * (n + 1))
    assert fused([3] * 3)
