"""out = x @ Wᵀ (+ bias) for few rows (decode): one program per BLOCK_N output columns, K streamed.

The rows are padded to a 16-, 32- or 64-row tl.dot tile (tensor cores; the waste is free when
memory bound), and no program splits K, so no second reduction kernel runs (cuBLAS splits K for
the 4096-wide outputs at 17-64 rows and reduces in a second launch). Tile configurations come from
sweeps over the 7B projection shapes (benchmarks/linear_bench.py; figures in docs/benchmarks/engine.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton import pdl
from kernels.triton.compile_ahead import launcher

MAX_ROWS = 64  # the most rows this kernel serves


@dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def row_tile(num_rows: int) -> int:
    """Rows of the padded tile: 16 (tl.dot's minimum), 32 or 64."""
    assert 1 <= num_rows <= MAX_ROWS, num_rows
    return max(16, triton.next_power_of_2(num_rows))


def linear_config(num_rows: int, out_features: int, in_features: int) -> LinearConfig:
    """Wide outputs (gate_up, lm_head) have programs to spare: wider tiles, shorter K steps; narrow
    outputs (o) and long K (down) want long K steps to keep enough bytes in flight per program,
    as long as the stages of a taller row tile still fit in shared memory."""
    if out_features >= 16384:
        return LinearConfig(block_n=64, block_k=128, num_warps=4, num_stages=3)
    if in_features >= 8192 or out_features <= 4096:
        return LinearConfig(block_n=32, block_k=512 if row_tile(num_rows) == 16 else 256, num_warps=4, num_stages=4)
    if row_tile(num_rows) == 16:
        return LinearConfig(block_n=32, block_k=128, num_warps=4, num_stages=4)
    return LinearConfig(block_n=128, block_k=128, num_warps=4, num_stages=4)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: LinearConfig | None = None, compile_only: bool = False) -> torch.Tensor:
    """x: [M <= 64, K], weight: [N, K] (rows contiguous), bias: [N] or None -> [M, N] in x's dtype.
    compile_only: compile the kernel these arguments select without launching it (warm_up_linear)."""
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    assert weight.shape[1] == in_features and weight.stride(1) == 1, (x.shape, weight.shape)
    assert x.stride(1) == 1 and weight.dtype == x.dtype, (x.stride(), weight.dtype, x.dtype)
    assert bias is None or bias.shape == (out_features,), bias.shape
    block_m = row_tile(num_rows)
    cfg = config or linear_config(num_rows, out_features, in_features)
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    launcher(_skinny_linear_kernel, (triton.cdiv(out_features, cfg.block_n),), compile_only)(
        x, weight, bias if bias is not None else weight, out, num_rows, out_features, in_features,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(x.device))
    return out


# Row counts that select every variant: Triton specializes num_rows on being 1 or a multiple of 16,
# and row_tile picks 16 or 32 rows. Decode graphs capture 1, 2, 4, 8, 16, 32, ... rows only, so an
# eager step of 17-31 tokens met a variant of its own while serving.
WARM_UP_ROWS = (1, 2, 16, 17, 32)


def warm_up_linear(projections: Iterable[tuple[torch.Tensor, torch.Tensor | None]], max_rows: int) -> int:
    """Compile each (weight, bias)'s variants for up to `max_rows` rows (kernels.SKINNY_MAX_ROWS),
    launching nothing; projections of one shape share them. Returns the variants requested."""
    shapes = {(w.shape, w.dtype, w.device, bias is not None): (w, bias) for w, bias in projections}
    requested = 0
    for weight, bias in shapes.values():
        x = torch.empty(max_rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        for rows in (r for r in WARM_UP_ROWS if r <= max_rows):
            skinny_linear(x[:rows], weight, bias, compile_only=True)
            requested += 1
    return requested


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, num_rows, out_features, in_features,
                          stride_xm, stride_wn, stride_om,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < out_features
    m_mask = offs_m < num_rows
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn      # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, in_features, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_features
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)           # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N] = Wᵀ tile
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])
