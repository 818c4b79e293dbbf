"""Paged attention: store_kv, the torch reference against a naive float64 loop, and the Triton kernels
(interpreter on CPU) against the reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels import paged_attention
from kernels.attention import AttentionMetadata, paged_attention_reference, store_kv
from kernels.triton.attention import TileConfig, paged_attention_triton

HEAD_DIM = 32
SCALE = HEAD_DIM ** -0.5
PAD_ROWS = 2  # trailing rows of q outside every sequence, as in a padded CUDA-graph batch

# Sequences as (cached tokens, new tokens): seq_len = cached + new, query_len = new.
CASES = {
    # decodes at different contexts, a prompt chunk from 0, a chunk after a cached prefix, graph padding
    "mixed": ((0, 1), (6, 1), (0, 20), (13, 11), (0, 0), (40, 1), (5, 0)),
    "decode_only": ((3, 1), (0, 1), (31, 1), (16, 1), (57, 1), (8, 1)),
    # chunks whose first query sits just before a key-block edge (catches off-by-one causal skipping)
    "prefill_only": ((0, 37), (21, 26), (14, 20), (62, 9)),
}
HEADS = {"gqa": (4, 2), "mha": (2, 2), "gqa3": (6, 2), "mqa": (8, 1)}  # (num_heads, num_kv_heads)


@dataclass
class Batch:
    q: torch.Tensor        # [num_tokens, num_heads, HEAD_DIM]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    v_cache: torch.Tensor
    meta: AttentionMetadata


def _make_batch(case: str, heads: str, block_size: int, dtype: torch.dtype, seed: int = 0) -> Batch:
    """Random caches whose blocks are handed to the sequences in shuffled order (interleaved), with
    every block (used or not) holding random K/V so that a wrong block would show. The new tokens'
    K/V go in through store_kv, as the engine does before attention."""
    g = torch.Generator().manual_seed(seed)
    seqs = CASES[case]
    num_heads, num_kv_heads = HEADS[heads]
    needed = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = 1 + sum(needed) + 3  # block 0 is the scratch block; a few stay unused
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    max_blocks = max(max(needed), 1) + 1  # one extra column: unused entries point at block 0
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for col in range(max(needed)):  # deal blocks round-robin so sequences interleave in the cache
        for s, count in enumerate(needed):
            if col < count:
                block_tables[s, col] = free.pop()

    query_lens = [n for _, n in seqs]
    starts = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    num_tokens = int(starts[-1]) + PAD_ROWS
    slots = []
    for s, (cached, new) in enumerate(seqs):
        for pos in range(cached, cached + new):
            slots.append(int(block_tables[s, pos // block_size]) * block_size + pos % block_size)
    slots += list(range(PAD_ROWS))  # padding tokens write into the scratch block
    meta = AttentionMetadata(
        query_start_loc=starts, seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=block_tables, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens), max_seq_len=max(c + n for c, n in seqs))

    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    k_new = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=g).to(dtype)
    v_new = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=g).to(dtype)
    store_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=g).to(dtype)
    return Batch(q, k_cache, v_cache, meta)


def _naive(batch: Batch) -> torch.Tensor:
    """Token by token, head by head, keys read through the block table, in float64. NaN where no
    sequence owns the row."""
    q, meta = batch.q.double(), batch.meta
    block_size, num_kv_heads = batch.k_cache.shape[1], batch.k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.full_like(q, float("nan"))
    starts = meta.query_start_loc.tolist()
    for s, seq_len in enumerate(meta.seq_lens.tolist()):
        query_len = starts[s + 1] - starts[s]
        for i in range(query_len):
            pos = seq_len - query_len + i
            blocks = [int(meta.block_tables[s, key // block_size]) for key in range(pos + 1)]
            offsets = [key % block_size for key in range(pos + 1)]
            k = batch.k_cache[blocks, offsets].double()  # [pos + 1, num_kv_heads, HEAD_DIM]
            v = batch.v_cache[blocks, offsets].double()
            for h in range(q.shape[1]):
                weights = torch.softmax(k[:, h // group] @ q[starts[s] + i, h] * SCALE, dim=0)
                out[starts[s] + i, h] = weights @ v[:, h // group]
    return out


def _covered(batch: Batch) -> slice:
    return slice(0, int(batch.meta.query_start_loc[-1]))


TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_writes_exactly_the_mapped_slots(dtype):
    batch = _make_batch("mixed", "gqa", 8, dtype)
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(batch.q.shape[0], 2, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    slots = batch.meta.slot_mapping[:-PAD_ROWS]  # distinct slots (padding rows may share the scratch block)
    store_kv(k[:-PAD_ROWS], v[:-PAD_ROWS], k_cache, v_cache, slots)

    written = torch.zeros(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    written[slots] = True
    for cache, before, new in ((k_cache, batch.k_cache, k), (v_cache, batch.v_cache, v)):
        flat, flat_before = cache.view(-1, 2, HEAD_DIM), before.view(-1, 2, HEAD_DIM)
        assert torch.equal(flat[slots], new[:-PAD_ROWS])
        assert torch.equal(flat[~written], flat_before[~written])


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_matches_naive_loop(case, heads, block_size, dtype):
    batch = _make_batch(case, heads, block_size, dtype)
    out = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, SCALE)
    expected = _naive(batch)
    assert out.dtype == dtype and out.shape == batch.q.shape
    rows = _covered(batch)
    torch.testing.assert_close(out[rows].double(), expected[rows], atol=TOLERANCE[dtype], rtol=0)


def test_dispatch_uses_the_reference_off_cuda():
    batch = _make_batch("mixed", "gqa", 16, torch.float32)
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, SCALE)
    expected = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, SCALE)
    assert torch.equal(out, expected)


SMALL_TILES = TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)  # many key blocks per tile

# (case, heads, block_size, dtype, tiles, num_splits): None = the production choice for the batch.
TRITON_CASES = [
    ("mixed", "gqa", 16, torch.float32, None, 1),
    ("mixed", "gqa", 8, torch.float16, SMALL_TILES, 1),
    ("mixed", "mha", 8, torch.float32, SMALL_TILES, 3),
    ("mixed", "gqa3", 16, torch.float16, SMALL_TILES, 2),
    ("decode_only", "gqa", 8, torch.float32, None, 1),
    ("decode_only", "gqa3", 16, torch.float32, SMALL_TILES, 4),
    ("decode_only", "mha", 16, torch.float16, None, 2),
    ("prefill_only", "mha", 16, torch.float16, None, 1),
    ("prefill_only", "gqa", 8, torch.float32, SMALL_TILES, 1),
    ("prefill_only", "gqa3", 8, torch.float32, SMALL_TILES, 3),
    ("prefill_only", "gqa", 16, torch.float16, None, None),
    ("mixed", "mqa", 8, torch.float32, None, None),
    ("mixed", "mqa", 16, torch.float16, SMALL_TILES, 2),
]


@pytest.mark.parametrize("case,heads,block_size,dtype,tiles,num_splits", TRITON_CASES)
def test_triton_matches_reference(case, heads, block_size, dtype, tiles, num_splits):
    batch = _make_batch(case, heads, block_size, dtype, seed=7)
    out = torch.full_like(batch.q, float("nan"))  # poisoned: every covered element must be written
    paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, SCALE,
                           out=out, tiles=tiles, num_splits=num_splits)
    expected = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, SCALE)
    rows = _covered(batch)
    torch.testing.assert_close(out[rows].float(), expected[rows].float(), atol=TOLERANCE[dtype], rtol=0)
    assert out[rows.stop:].isnan().all(), "rows outside every sequence must be left alone"
