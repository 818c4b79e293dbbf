"""KV cache and the attention over it, behind one small interface (a paged cache replaces it later).

ContiguousKVCache gives each sequence its own K/V tensors sized for prompt + max_tokens, allocated
at admission and freed at finish or abort; attention is one torch SDPA call per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from gpu_worker.forward_context import SeqSlice


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


class KVCache(Protocol):
    def can_allocate(self, num_tokens: int) -> bool: ...
    def allocate(self, seq_id: int, num_tokens: int) -> None: ...
    def free(self, seq_id: int) -> None: ...
    def free_tokens(self) -> int: ...
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               seqs: tuple[SeqSlice, ...], scale: float) -> torch.Tensor: ...


class ContiguousKVCache:
    """Per-sequence contiguous K/V: [num_layers, capacity, num_kv_heads, head_dim] each."""

    def __init__(self, shape: CacheShape, capacity_tokens: int) -> None:
        self.shape = shape
        self.capacity_tokens = capacity_tokens  # budget over all sequences
        self._entries: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._used = 0

    def can_allocate(self, num_tokens: int) -> bool:
        return self._used + num_tokens <= self.capacity_tokens

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        assert seq_id not in self._entries, seq_id
        assert self.can_allocate(num_tokens), (num_tokens, self.free_tokens())
        s = self.shape
        size = (s.num_layers, num_tokens, s.num_kv_heads, s.head_dim)
        self._entries[seq_id] = (torch.empty(size, dtype=s.dtype, device=s.device),
                                 torch.empty(size, dtype=s.dtype, device=s.device))
        self._used += num_tokens

    def free(self, seq_id: int) -> None:
        k, _ = self._entries.pop(seq_id)
        self._used -= k.shape[1]

    def free_tokens(self) -> int:
        return self.capacity_tokens - self._used

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               seqs: tuple[SeqSlice, ...], scale: float) -> torch.Tensor:
        """Store the new K/V, then attend each sequence's new queries to its whole cached prefix.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        returns [num_tokens, num_heads, head_dim]
        """
        out = torch.empty_like(q)
        for seq in seqs:
            rows = slice(seq.token_start, seq.token_start + seq.num_new)
            end = seq.cache_start + seq.num_new
            k_cache, v_cache = self._entries[seq.seq_id]
            k_cache[layer, seq.cache_start:end] = k[rows]
            v_cache[layer, seq.cache_start:end] = v[rows]
            # New query i sits at position cache_start + i and sees keys 0..cache_start + i.
            query_pos = torch.arange(seq.cache_start, end, device=q.device)
            mask = torch.arange(end, device=q.device)[None, :] <= query_pos[:, None]  # [num_new, end]
            attended = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1),                # [num_heads, num_new, head_dim]
                k_cache[layer, :end].transpose(0, 1),   # [num_kv_heads, end, head_dim]
                v_cache[layer, :end].transpose(0, 1),
                attn_mask=mask, scale=scale, enable_gqa=True)
            out[rows] = attended.transpose(0, 1)
        return out
