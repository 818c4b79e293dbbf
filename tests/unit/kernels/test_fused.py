"""Fused decoder ops: the torch references against naive float64 math, and the Triton kernels
(interpreter on CPU) against the references, with NaN-poisoned outputs so that every element the
kernels must write is proven written (and the cache slots they must not touch stay NaN)."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_add_rms_norm, rms_norm, rotary_store_kv, silu_and_mul
from kernels.fused import (fused_add_rms_norm_reference, rms_norm_reference, rotary_store_kv_reference,
                           silu_and_mul_reference)
from kernels.triton import fused as triton_fused

DTYPES = [torch.float32, torch.float16]
EPS = 1e-5
NORM_SHAPES = [(1, 32), (7, 96), (19, 64)]  # (num_tokens, hidden); 96 leaves masked columns in the block
SILU_SHAPES = [(1, 32), (9, 80), (2, 1030)]  # (num_tokens, inter); 1030 spans two SILU_BLOCK column tiles
HEADS = {"gqa": (4, 2, 16), "mha": (2, 2, 32), "mqa": (6, 1, 16), "wide": (3, 2, 64)}  # (heads, kv heads, dim)
BLOCK_SIZE, NUM_BLOCKS = 8, 6
REAL_TOKENS, PAD_TOKENS = 11, 2  # padded rows of a CUDA-graph batch write their K/V to scratch slot 0

# Kernel vs reference: the same roundings in the same order; only rsqrt/exp may differ in the last bit.
KERNEL_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-3)}
# Reference vs float64: relative error of the whole output (fp16 rounds each step to 2^-11).
NAIVE_REL = {torch.float32: 1e-6, torch.float16: 2e-3}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def _nan(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def _naive_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return weight.double() * x / (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt()


def _norm_inputs(shape: tuple[int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = _randn(*shape, dtype=dtype, seed=1)
    residual = _randn(*shape, dtype=dtype, seed=2) * 3
    weight = (1 + 0.5 * _randn(shape[1], dtype=torch.float32, seed=3)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_references_match_float64(shape, dtype):
    x, residual, weight = _norm_inputs(shape, dtype)
    assert _rel_err(rms_norm_reference(x, weight, EPS), _naive_rms_norm(x, weight)) < NAIVE_REL[dtype]
    normed, summed = fused_add_rms_norm_reference(x, residual, weight, EPS)
    assert _rel_err(summed, x.double() + residual.double()) < NAIVE_REL[dtype]
    assert _rel_err(normed, _naive_rms_norm(summed, weight)) < NAIVE_REL[dtype]
    # On CPU the public ops are the references.
    assert torch.equal(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS))
    assert all(map(torch.equal, fused_add_rms_norm(x, residual, weight, EPS), (normed, summed)))


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_kernel_matches_reference(shape, dtype):
    x, _, weight = _norm_inputs(shape, dtype)
    out = _nan(*shape, dtype=dtype)
    triton_fused.add_rms_norm(x, None, weight, EPS, out, None)
    torch.testing.assert_close(out, rms_norm_reference(x, weight, EPS), **KERNEL_TOL[dtype])


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_kernel_matches_reference(shape, dtype):
    x, residual, weight = _norm_inputs(shape, dtype)
    # x is a column slice of a wider tensor: rows are read through their stride.
    wide = torch.cat((x, _randn(*shape, dtype=dtype, seed=4)), dim=1)
    out, residual_out = _nan(*shape, dtype=dtype), _nan(*shape, dtype=dtype)
    triton_fused.add_rms_norm(wide[:, :shape[1]], residual, weight, EPS, out, residual_out)
    normed, summed = fused_add_rms_norm_reference(x, residual, weight, EPS)
    assert torch.equal(residual_out, summed)  # one rounding of an exact float32 sum: bit-equal
    torch.testing.assert_close(out, normed, **KERNEL_TOL[dtype])


@pytest.mark.parametrize("shape", SILU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(shape, dtype):
    num_tokens, inter = shape
    gate_up = _randn(num_tokens, 2 * inter, dtype=dtype, seed=5) * 4
    expected = silu_and_mul_reference(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert _rel_err(expected, gate * torch.sigmoid(gate) * up) < NAIVE_REL[dtype]
    assert torch.equal(silu_and_mul(gate_up), expected)

    out = _nan(num_tokens, inter, dtype=dtype)
    triton_fused.silu_and_mul(gate_up, out)
    torch.testing.assert_close(out, expected, **KERNEL_TOL[dtype])


def _rotary_case(heads: str, dtype: torch.dtype):
    """qkv rows of REAL_TOKENS tokens at random positions with distinct cache slots outside the
    scratch block, then PAD_TOKENS padding rows mapped to slot 0; cos/sin from float64 angles."""
    num_heads, num_kv_heads, head_dim = HEADS[heads]
    num_tokens = REAL_TOKENS + PAD_TOKENS
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=6)
    positions = torch.randint(0, 4096, (num_tokens,), generator=_gen(7)).double()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)  # [num_tokens, head_dim]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    real_slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE - BLOCK_SIZE, generator=_gen(8))[:REAL_TOKENS] + BLOCK_SIZE
    slots = torch.cat((real_slots, torch.zeros(PAD_TOKENS, dtype=torch.int64)))
    return qkv, cos, sin, slots, (num_heads, num_kv_heads, head_dim)


def _nan_caches(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(_nan(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype) for _ in range(2))


def _naive_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] in float64, pair (i, i + half) rotated by the token's angle i."""
    x, cos, sin = x.double(), cos.double()[:, None], sin.double()[:, None]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:]), -1)


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_kv_reference_matches_float64(heads, dtype):
    qkv, cos, sin, slots, (num_heads, num_kv_heads, head_dim) = _rotary_case(heads, dtype)
    k_cache, v_cache = _nan_caches(num_kv_heads, head_dim, dtype)
    q = rotary_store_kv(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim)

    q_in, k_in, v_in = qkv.view(qkv.shape[0], -1, head_dim).split((num_heads, num_kv_heads, num_kv_heads), dim=1)
    assert q.shape == (qkv.shape[0], num_heads, head_dim) and q.is_contiguous()
    assert _rel_err(q, _naive_rotary(q_in, cos, sin)) < NAIVE_REL[dtype]
    real = slice(0, REAL_TOKENS)
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    assert _rel_err(flat_k[slots[real]], _naive_rotary(k_in[real], cos[real], sin[real])) < NAIVE_REL[dtype]
    assert torch.equal(flat_v[slots[real]], v_in[real])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


@pytest.mark.parametrize("rotary_elements", [triton_fused.ROTARY_ELEMENTS, 32])  # 32: several head tiles
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_kv_kernel_matches_reference(heads, dtype, rotary_elements, monkeypatch):
    monkeypatch.setattr(triton_fused, "ROTARY_ELEMENTS", rotary_elements)
    qkv, cos, sin, slots, (num_heads, num_kv_heads, head_dim) = _rotary_case(heads, dtype)
    k_expected, v_expected = _nan_caches(num_kv_heads, head_dim, dtype)
    q_expected = rotary_store_kv_reference(qkv, cos, sin, k_expected, v_expected, slots, num_heads, num_kv_heads,
                                           head_dim)
    k_cache, v_cache = _nan_caches(num_kv_heads, head_dim, dtype)
    q = _nan(qkv.shape[0], num_heads, head_dim, dtype=dtype)
    triton_fused.rotary_store_kv(qkv, cos, sin, k_cache, v_cache, slots, q)

    # Only products and sums, rounded where the reference rounds: bit-equal.
    assert torch.equal(q, q_expected)
    # Every slot but the scratch one (which padding rows race for) is equal, NaN where unwritten.
    for cache, expected in ((k_cache, k_expected), (v_cache, v_expected)):
        flat, flat_expected = cache.view(-1, num_kv_heads, head_dim), expected.view(-1, num_kv_heads, head_dim)
        torch.testing.assert_close(flat[1:], flat_expected[1:], equal_nan=True, rtol=0, atol=0)
        assert not flat[0].isnan().any()
