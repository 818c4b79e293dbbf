"""The skinny decode matmul (Triton interpreter on CPU) against torch in float64, with shapes that
are not multiples of any tile, with and without bias; and the dispatcher's choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import linear
from kernels.triton.linear import LinearConfig, skinny_linear

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
