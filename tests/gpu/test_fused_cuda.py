"""The fused decoder kernels on a CUDA device in bfloat16 (the interpreter cannot run bf16): against
the float32 torch references on the same (bf16-rounded) inputs, relative error under 1e-2, and
against the bf16 references run eagerly on the GPU (the same roundings: equal up to the last bit of
rsqrt/exp, bit-equal for rotary); then one CUDA graph of all three replayed on new inputs and slots.
Run through the device tool: `python3 -m pytest -m gpu tests/gpu -q`."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_add_rms_norm, rms_norm, rotary_store_kv, silu_and_mul
from kernels.fused import (fused_add_rms_norm_reference, rms_norm_reference, rotary_store_kv_reference,
                           silu_and_mul_reference)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BF16_REL = 1e-2
SAME_ROUNDINGS = dict(rtol=1.6e-2, atol=1e-5)  # vs the bf16 eager reference: ~2 ulp (rsqrt, exp may differ)
EPS = 1e-5
BLOCK_SIZE = 16


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double().cpu() - expected.double().cpu()).norm() / expected.double().cpu().norm()).item()


def _bf16(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(1, 4096), (37, 8192), (5, 96)])
def test_norms_bf16(shape):
    torch.manual_seed(0)
    x, residual = _bf16(*shape), _bf16(*shape, scale=3.0)
    weight = (1 + 0.5 * torch.randn(shape[1], device="cuda")).bfloat16()
    out = rms_norm(x, weight, EPS)
    assert _rel_err(out, rms_norm_reference(x.float(), weight.float(), EPS)) < BF16_REL
    torch.testing.assert_close(out, rms_norm_reference(x, weight, EPS), **SAME_ROUNDINGS)

    normed, summed = fused_add_rms_norm(x, residual, weight, EPS)
    expected_normed, expected_summed = fused_add_rms_norm_reference(x, residual, weight, EPS)
    assert torch.equal(summed, expected_summed)
    torch.testing.assert_close(normed, expected_normed, **SAME_ROUNDINGS)
    assert _rel_err(normed, rms_norm_reference(summed.float(), weight.float(), EPS)) < BF16_REL


@pytest.mark.parametrize("shape", [(1, 11008), (29, 14336), (3, 80)])
def test_silu_and_mul_bf16(shape):
    torch.manual_seed(1)
    gate_up = _bf16(shape[0], 2 * shape[1], scale=4.0)
    out = silu_and_mul(gate_up)
    assert _rel_err(out, silu_and_mul_reference(gate_up.float())) < BF16_REL
    torch.testing.assert_close(out, silu_and_mul_reference(gate_up), **SAME_ROUNDINGS)


def _rotary_inputs(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, num_blocks: int):
    """qkv, cos, sin as the model makes them, and distinct slots outside scratch block 0."""
    qkv = _bf16(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda")
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    slots = torch.randperm((num_blocks - 1) * BLOCK_SIZE, device="cuda")[:num_tokens] + BLOCK_SIZE
    return qkv, emb.cos().bfloat16(), emb.sin().bfloat16(), slots


@pytest.mark.parametrize("num_tokens, heads", [(1, (32, 8, 128)), (300, (32, 8, 128)), (9, (4, 2, 16)),
                                               (17, (16, 16, 64))])
def test_rotary_store_kv_bf16(num_tokens, heads):
    torch.manual_seed(2)
    num_heads, num_kv_heads, head_dim = heads
    num_blocks = num_tokens // BLOCK_SIZE + 4
    qkv, cos, sin, slots = _rotary_inputs(num_tokens, num_heads, num_kv_heads, head_dim, num_blocks)
    caches = {name: torch.zeros(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, device="cuda", dtype=dtype)
              for name, dtype in (("k", torch.bfloat16), ("v", torch.bfloat16), ("k32", torch.float32),
                                  ("v32", torch.float32), ("k16", torch.bfloat16), ("v16", torch.bfloat16))}
    q = rotary_store_kv(qkv, cos, sin, caches["k"], caches["v"], slots, num_heads, num_kv_heads, head_dim)
    q32 = rotary_store_kv_reference(qkv.float(), cos.float(), sin.float(), caches["k32"], caches["v32"], slots,
                                    num_heads, num_kv_heads, head_dim)
    q16 = rotary_store_kv_reference(qkv, cos, sin, caches["k16"], caches["v16"], slots, num_heads, num_kv_heads,
                                    head_dim)
    assert _rel_err(q, q32) < BF16_REL
    # Products and sums only, each rounded as eager torch rounds it (FMA contraction is off): bit-equal.
    assert torch.equal(q, q16)
    for name in ("k", "v"):
        assert _rel_err(caches[name], caches[name + "32"]) < BF16_REL
        assert torch.equal(caches[name], caches[name + "16"])


def test_graph_replays_new_inputs_and_slots():
    """One layer's elementwise ops captured once, replayed after new activations, rotary angles and
    cache slots were copied into the static inputs: the kernels read them from device memory."""
    torch.manual_seed(3)
    num_tokens, hidden, inter, (num_heads, num_kv_heads, head_dim), num_blocks = 8, 256, 512, (4, 2, 32), 6

    def fresh() -> tuple[torch.Tensor, ...]:
        """x, residual, qkv, cos, sin, slots, gate_up."""
        rotary = _rotary_inputs(num_tokens, num_heads, num_kv_heads, head_dim, num_blocks)
        return _bf16(num_tokens, hidden), _bf16(num_tokens, hidden), *rotary, _bf16(num_tokens, 2 * inter)

    static = fresh()
    weight = (1 + 0.5 * torch.randn(hidden, device="cuda")).bfloat16()
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)

    def step():
        x, residual, qkv, cos, sin, slots, gate_up = static
        normed, summed = fused_add_rms_norm(x, residual, weight, EPS)
        q = rotary_store_kv(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim)
        return normed, summed, q, silu_and_mul(gate_up)

    step()  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    live = fresh()
    for dst, src in zip(static, live):
        dst.copy_(src)
    k_cache.zero_()
    v_cache.zero_()
    graph.replay()

    x, residual, qkv, cos, sin, slots, gate_up = live
    k_expected, v_expected = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    expected = (*fused_add_rms_norm_reference(x, residual, weight, EPS),
                rotary_store_kv_reference(qkv, cos, sin, k_expected, v_expected, slots, num_heads, num_kv_heads,
                                          head_dim),
                silu_and_mul_reference(gate_up))
    for actual, wanted in zip((*outputs, k_cache, v_cache), (*expected, k_expected, v_expected)):
        torch.testing.assert_close(actual, wanted, **SAME_ROUNDINGS)
