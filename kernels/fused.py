"""The decoder layer's elementwise work fused into few launches: RMSNorm (with the residual add
before it), rotary + K/V store, SiLU-and-mul.

Why. At batch 1 each small torch op of a layer (pow, mean, rsqrt, mul, cast, slice, cat, add, ...)
is a launch of its own even inside a CUDA graph; fused, a layer launches one kernel per op below
(kernels.<op>):

    (normed, residual) = fused_add_rms_norm(attn_or_mlp_out, residual, weight, eps)
    q = rotary_store_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, ...)   # K/V land in the cache
    act = silu_and_mul(gate_up)

This module holds the ops' contract (the checks both backends pass) and their torch references;
kernels/__init__.py runs the Triton kernels (kernels/triton/fused.py) on CUDA and the references
elsewhere. The references compute exactly what Hugging Face's eager Llama computes (float32
statistics, rounding to the model's dtype wherever eager torch rounds) and are what the kernels
are tested against; the kernels repeat those roundings, so bf16 results match the reference up to
the last bit of a few transcendentals.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import store_kv


def check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.dim() == 2 and weight.shape == (x.shape[1],), (x.shape, weight.shape)
    assert weight.dtype == x.dtype, (weight.dtype, x.dtype)


def check_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> None:
    num_tokens = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim, (qkv.shape, num_heads)
    assert cos.shape == sin.shape == (num_tokens, head_dim), (cos.shape, sin.shape, qkv.shape)
    assert cos.dtype == sin.dtype == qkv.dtype, (cos.dtype, qkv.dtype)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim), k_cache.shape
    assert k_cache.dtype == v_cache.dtype == qkv.dtype, (k_cache.dtype, qkv.dtype)
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64, slot_mapping.shape
    assert head_dim % 2 == 0, head_dim


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: statistics in float32, the normalized x rounded to x's dtype, then scaled."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm_reference(residual, weight, eps), residual


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_store_kv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                              num_kv_heads: int, head_dim: int) -> torch.Tensor:
    n, kv_size = qkv.shape[0], num_kv_heads * head_dim
    q, k, v = qkv.split((num_heads * head_dim, kv_size, kv_size), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [num_tokens, 1, head_dim]: broadcast over heads
    q = _apply_rotary(q.view(n, num_heads, head_dim), cos, sin)
    k = _apply_rotary(k.view(n, num_kv_heads, head_dim), cos, sin)
    store_kv(k, v.view(n, num_kv_heads, head_dim), k_cache, v_cache, slot_mapping)
    return q


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, 1, head_dim]. Each product and the
    sum round to the dtype (eager HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # HF rotate_half
    return x * cos + rotated * sin
