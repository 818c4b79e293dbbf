"""Paged attention over a block-table KV cache: the contract, the K/V store, and the torch reference.

The KV cache of one layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]. A step
packs the new tokens of every scheduled sequence into q: a decode adds 1 row, a prefill chunk n rows.
A chunk attends causally to the K/V cached by earlier chunks plus its own, which the caller has
already written with `store_kv`. Example, a 3-token chunk of a prompt whose first 5 tokens are cached
and a decode at context 9 (block_size 4):

    query_start_loc = [0, 3, 4]   seq_lens = [8, 9]   query positions: [5, 6, 7] and [8]
    block_tables    = [[7, 2, 0], [3, 5, 1]]          key 6 of sequence 0 -> row 2 * 4 + 2 of the cache

kernels.paged_attention runs the Triton kernels (kernels/triton/attention.py) on CUDA and the reference
elsewhere; the reference is also the ground truth the kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1] cumulative new-token counts (rows of q)
    seq_lens: torch.Tensor         # int32 [num_seqs] tokens in context after this step (cached + new)
    block_tables: torch.Tensor     # int32 [num_seqs, max_blocks_per_seq]; unused entries any valid block id
    slot_mapping: torch.Tensor     # int64 [num_tokens] flat cache slot per new token: block * block_size + offset
    max_query_len: int             # host: >= every sequence's new-token count
    max_seq_len: int               # host: >= every seq_len

    def __post_init__(self) -> None:
        # Shapes and dtypes only: checking values would sync with the device.
        num_seqs = self.seq_lens.shape[0]
        assert self.query_start_loc.shape == (num_seqs + 1,), (self.query_start_loc.shape, num_seqs)
        assert self.block_tables.dim() == 2 and self.block_tables.shape[0] == num_seqs, self.block_tables.shape
        assert self.slot_mapping.dim() == 1, self.slot_mapping.shape
        assert self.query_start_loc.dtype == self.seq_lens.dtype == self.block_tables.dtype == torch.int32
        assert self.slot_mapping.dtype == torch.int64
        assert self.max_query_len >= 0 and self.max_seq_len >= 0

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V at its flat slot of the caches (graph-safe: one index_copy_ each).

    k, v:             [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping:     int64 [num_tokens]
    """
    assert k.shape == v.shape and k.shape[1:] == k_cache.shape[2:], (k.shape, v.shape, k_cache.shape)
    assert k_cache.shape == v_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.dtype == k_cache.dtype and v.dtype == v_cache.dtype, (k.dtype, k_cache.dtype)
    assert slot_mapping.shape == (k.shape[0],), (slot_mapping.shape, k.shape)
    flat = (-1, *k_cache.shape[2:])  # [num_blocks * block_size, num_kv_heads, head_dim]
    k_cache.view(flat).index_copy_(0, slot_mapping, k)
    v_cache.view(flat).index_copy_(0, slot_mapping, v)


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """The shape contract shared by both backends (host-side checks only)."""
    assert q.dim() == 3 and k_cache.dim() == 4, (q.shape, k_cache.shape)
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype == q.dtype, (k_cache.shape, q.dtype)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    assert q.shape[2] == head_dim, (q.shape, k_cache.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} must be a power of two >= 16"
    assert block_size >= 8 and block_size & (block_size - 1) == 0, f"block_size {block_size}: power of two >= 8"
    assert meta.slot_mapping.shape[0] == q.shape[0], (meta.slot_mapping.shape, q.shape)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Per sequence: gather its K/V through the block table, then one SDPA with a causal offset mask."""
    check_inputs(q, k_cache, v_cache, meta)
    block_size = k_cache.shape[1]
    out = torch.zeros_like(q)
    starts = meta.query_start_loc.tolist()
    for s, seq_len in enumerate(meta.seq_lens.tolist()):
        q_start, q_end = starts[s], starts[s + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        keys = torch.arange(seq_len, device=q.device)
        blocks = meta.block_tables[s, keys // block_size].long()
        k = k_cache[blocks, keys % block_size]  # [seq_len, num_kv_heads, head_dim]
        v = v_cache[blocks, keys % block_size]
        # New token i sits at position seq_len - query_len + i and sees keys 0..that position.
        positions = torch.arange(seq_len - query_len, seq_len, device=q.device)
        mask = keys[None, :] <= positions[:, None]  # [query_len, seq_len]
        attended = F.scaled_dot_product_attention(
            q[q_start:q_end].float().transpose(0, 1)[None],  # [1, num_heads, query_len, head_dim]
            k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None],
            attn_mask=mask, scale=scale, enable_gqa=True)
        out[q_start:q_end] = attended[0].transpose(0, 1).to(q.dtype)
    return out
