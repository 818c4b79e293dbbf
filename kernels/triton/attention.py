"""Triton paged attention: one flash-attention kernel serves prefill chunks and decodes alike.

Why one kernel. A step mixes decodes (1 new token) and prefill chunks (n new tokens after a cached
prefix); both are "a few query rows attend causally to keys read through a block table". One kernel
with per-batch tile sizes keeps one code path (and one set of bugs) while giving each case what it
needs:
  - The M dimension of tl.dot holds BLOCK_Q tokens x GROUP_PAD query heads of one kv group
    (row r = token r // GROUP_PAD, head r % GROUP_PAD), so a group's K/V is read once per tile.
    Decode batches use BLOCK_M 16 (the tl.dot minimum; a tile holds one sequence, so rows beyond its
    group's heads idle, which costs nothing in a memory-bound loop); prefill uses BLOCK_M 64 x BLOCK_N 64.
  - Decode is memory-bound and needs many programs: when (tiles x kv heads) cannot fill the GPU,
    each tile's keys are split in NUM_SPLITS ranges (flash-decoding) and a second small kernel
    combines the partial results by their log-sum-exp.
  - Prefill skips key blocks past the causal limit and applies the causal mask only to the blocks
    that straddle the diagonal.

Grid (tiles, kv_heads, splits), all from host ints: tiles = num_tokens // BLOCK_Q + num_seqs bounds
the tiles of every sequence (sequence s owns tiles [qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s + 1),
found in-kernel by binary search); surplus tiles exit at once. No host syncs: CUDA-graph capturable.

Softmax runs online in float32 in the log2 domain (log2(e) folded into the scale, exp2).
Key k of sequence s lives at cache row block_tables[s, k // block_size] * block_size + k % block_size.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention import AttentionMetadata, check_inputs
from kernels.triton import pdl
from kernels.triton.compile_ahead import launcher


@dataclass(frozen=True)
class TileConfig:
    block_m: int     # query rows per program: tokens x padded query heads of one kv group
    block_n: int     # keys per inner-loop step
    num_warps: int
    num_stages: int


# GPU-tuning knobs, all in one place, picked by a sweep on Hopper (bf16, head_dim 128;
# docs/benchmarks/kernels.md): for prefill, 64x64 / 4 warps led or tied 128x64 and 128x128 / 8 warps
# at 2k-8k tokens; the split settings gave the fastest decode at batch 1..64, contexts 1k-4k
# (launched under CUDA graphs).
DECODE_TILES = TileConfig(block_m=16, block_n=32, num_warps=2, num_stages=2)
PREFILL_TILES = TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
TARGET_PROGRAMS = 4 * 132     # ~4 programs per SM of an H100/H200; fewer than this and KV is split
MIN_KEYS_PER_SPLIT = 64       # one BLOCK_N step: shorter splits only add combine work
MAX_SPLITS = 32


def choose_tiles(max_query_len: int, group_pad: int) -> TileConfig:
    """Decode tiles while every sequence's new rows fit one small tile, prefill tiles otherwise."""
    return DECODE_TILES if max_query_len * group_pad <= DECODE_TILES.block_m else PREFILL_TILES


def choose_num_splits(programs: int, max_seq_len: int) -> int:
    """How many key ranges each tile is split into so that the grid fills the GPU."""
    wanted = math.ceil(TARGET_PROGRAMS / max(programs, 1))
    return max(1, min(wanted, MAX_SPLITS, max_seq_len // MIN_KEYS_PER_SPLIT))


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, *, out: torch.Tensor | None = None, tiles: TileConfig | None = None,
                           num_splits: int | None = None, compile_only: bool = False) -> torch.Tensor:
    """Same contract as kernels.paged_attention.

    out:          [num_tokens, num_heads, head_dim] to write into (rows outside every sequence are left
                  as they are); a new tensor when None
    tiles:        tile sizes; chosen from meta.max_query_len when None (which only picks tiles: every
                  sequence's rows are covered whatever it says)
    num_splits:   key ranges per tile; chosen from the grid size and meta.max_seq_len when None
    compile_only: compile the kernels these arguments select without launching them (warm_up_attention)
    """
    check_inputs(q, k_cache, v_cache, meta)
    assert q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert meta.query_start_loc.is_contiguous() and meta.seq_lens.is_contiguous()
    assert meta.block_tables.stride(1) == 1, meta.block_tables.stride()
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous(), (out.shape, out.dtype)
    num_seqs = meta.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    tiles = tiles or choose_tiles(meta.max_query_len, group_pad)
    block_m = max(tiles.block_m, group_pad, 16)  # tl.dot needs M >= 16
    block_q = block_m // group_pad               # tokens per tile
    # Every sequence's new tokens fit one tile (decode): tile i is sequence i, no search for it.
    one_tile_per_seq = meta.max_query_len <= block_q
    num_tiles = num_seqs if one_tile_per_seq else num_tokens // block_q + num_seqs
    if num_splits is None:
        num_splits = choose_num_splits(num_tiles * num_kv_heads, meta.max_seq_len)
    assert num_splits >= 1, num_splits

    split = num_splits > 1
    # Each split's partial result (its output over its own softmax sum, and that sum's log2-sum-exp) goes
    # to a second kernel that combines them; without splits the kernel writes `out` and never reads these.
    if split:
        part_out = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out
    launcher(_paged_attention_kernel, (num_tiles, num_kv_heads, num_splits), compile_only)(
        q, k_cache, v_cache, out, part_out, part_lse,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        num_seqs, num_splits, num_heads, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, IS_SPLIT=split, ONE_TILE_PER_SEQ=one_tile_per_seq,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl.launch_options(q.device))
    if split:
        launcher(_combine_splits_kernel, (num_tokens, num_heads), compile_only)(
            out, part_out, part_lse, meta.query_start_loc, num_seqs, num_splits,
            HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4,
            **pdl.launch_options(q.device))
    return out


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning `tile`: the last s with query_start_loc[s] // BLOCK_Q + s <= tile.

    That first-tile index grows by >= 1 per sequence (even for query_len 0), so the owner is unique.
    """
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_keys(acc, l_i, m_i, q, q_pos, key0, key_hi, k_base, v_base, bt_row, qk_scale, stride_cache_row,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over keys [key0, key0 + BLOCK_N) ∩ [.., key_hi)."""
    keys = key0 + tl.arange(0, BLOCK_N)                                  # [BLOCK_N] positions in the sequence
    key_valid = keys < key_hi
    blocks = tl.load(bt_row + keys // BLOCK_SIZE, mask=key_valid, other=0)
    cache_rows = blocks.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE    # [BLOCK_N] physical rows
    dims = tl.arange(0, HEAD_DIM)
    k = tl.load(k_base + cache_rows[None, :] * stride_cache_row + dims[:, None],
                mask=key_valid[None, :], other=0.0)                       # [HEAD_DIM, BLOCK_N]
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale            # [BLOCK_M, BLOCK_N], log2 domain
    if CAUSAL:
        s = tl.where((keys[None, :] <= q_pos[:, None]) & key_valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet: keep exp2 finite
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    v = tl.load(v_base + cache_rows[:, None] * stride_cache_row + dims[None, :],
                mask=key_valid[:, None], other=0.0)                       # [BLOCK_N, HEAD_DIM]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new


def warm_up_attention(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> int:
    """Compile every variant a worker's steps can select (decode and prefill tiles, one tile per
    sequence or a search, each split count's combine) so that no request waits on a compile (a
    first prompt on a fresh machine used to stall for seconds on two of them). The arguments are
    stand-ins: a variant depends on the constexprs and the integer values Triton specializes on
    (here the model's head counts and strides), not on the batch. Returns the variants requested."""
    q = torch.empty(1, num_heads, head_dim, dtype=dtype, device=device)
    cache = torch.empty(1, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    ints = functools.partial(torch.zeros, dtype=torch.int32, device=device)
    meta = AttentionMetadata(query_start_loc=ints(2), seq_lens=ints(1), block_tables=ints(1, 1),
                             slot_mapping=torch.zeros(1, dtype=torch.int64, device=device),
                             max_query_len=1, max_seq_len=1)
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    prefill_q = max(PREFILL_TILES.block_m, group_pad, 16) // group_pad  # tokens of a prefill tile
    # (tiles, a max_query_len that selects them): decodes fit one tile per sequence; prefills may or not.
    cases = [(DECODE_TILES, 1), (PREFILL_TILES, prefill_q), (PREFILL_TILES, prefill_q + 1)]
    pad_of_splits = (1, *(2 ** i for i in range(1, MAX_SPLITS.bit_length())))  # each combine's SPLITS_PAD
    for tiles, query_len in cases:
        for splits in pad_of_splits:
            paged_attention_triton(q, cache, cache, dataclasses.replace(meta, max_query_len=query_len), 1.0,
                                   out=q, tiles=tiles, num_splits=splits, compile_only=True)
    return len(cases) * len(pad_of_splits)


# stride_bt_seq: block tables are as wide as a batch's longest sequence, and a width that is a
# multiple of 16 would otherwise compile a second kernel in the middle of serving.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_bt_seq"])
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
        num_seqs, num_splits, num_heads, qk_scale,
        stride_q_tok, stride_q_head, stride_cache_row, stride_cache_head, stride_bt_seq,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_SPLIT: tl.constexpr, ONE_TILE_PER_SEQ: tl.constexpr,
        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_inputs(PDL)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if ONE_TILE_PER_SEQ:  # decode: no chain of dependent loads before the keys can be fetched
        seq = tile
    else:
        seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if ONE_TILE_PER_SEQ:
        tile_start = 0
    else:
        tile_start = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first new token of the tile, in its sequence
    if tile_start >= query_len:
        return
    prefix = tl.load(seq_lens_ptr + seq) - query_len  # keys cached before this step

    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // GROUP_PAD                 # [BLOCK_M] new-token index in the sequence
    head = kv_head * GROUP + rows % GROUP_PAD            # [BLOCK_M] query head
    row_valid = (tok < query_len) & (rows % GROUP_PAD < GROUP)
    q_pos = prefix + tok                                 # [BLOCK_M] position in the sequence
    dims = tl.arange(0, HEAD_DIM)
    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]

    # Every row sees keys [0, full_end); the tile's last token sees [0, causal_end).
    full_end = prefix + tile_start + 1
    causal_end = prefix + tl.minimum(tile_start + BLOCK_Q, query_len)
    # This split's keys: a BLOCK_N-aligned share of [0, causal_end); split 0 always holds key 0.
    chunk = tl.cdiv(tl.cdiv(causal_end, num_splits), BLOCK_N) * BLOCK_N
    key_lo = split * chunk
    key_hi = tl.minimum(key_lo + chunk, causal_end)
    unmasked_hi = key_lo + tl.maximum(tl.minimum(key_hi, full_end) - key_lo, 0) // BLOCK_N * BLOCK_N

    bt_row = block_tables_ptr + seq * stride_bt_seq
    k_base = k_cache_ptr + kv_head * stride_cache_head
    v_base = v_cache_ptr + kv_head * stride_cache_head
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for key0 in range(key_lo, unmasked_hi, BLOCK_N):
        acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, q_pos, key0, key_hi, k_base, v_base, bt_row, qk_scale,
                                     stride_cache_row, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION)
    for key0 in range(unmasked_hi, key_hi, BLOCK_N):
        acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, q_pos, key0, key_hi, k_base, v_base, bt_row, qk_scale,
                                     stride_cache_row, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION)

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # l_i == 0 only for rows with no key in this split
    if IS_SPLIT:
        part = ((q_start + tok).to(tl.int64) * num_heads + head) * num_splits + split  # [BLOCK_M]
        tl.store(part_lse_ptr + part, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=row_valid)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc / l_safe[:, None],
                 mask=row_valid[:, None])
    else:
        tl.store(out_ptr + q_offs, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def _combine_splits_kernel(out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, num_seqs, num_splits,
                           HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr):
    """out[tok, head] = sum_s 2^lse_s * o_s / sum_s 2^lse_s over the splits' partial results."""
    pdl.wait_for_inputs(PDL)
    tok = tl.program_id(0)
    head = tl.program_id(1)
    if tok >= tl.load(query_start_loc_ptr + num_seqs):
        return  # a padding row outside every sequence
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_splits
    row = tok.to(tl.int64) * tl.num_programs(1) + head
    lse = tl.load(part_lse_ptr + row * num_splits + splits, mask=split_valid, other=float("-inf"))  # [SPLITS_PAD]
    weights = tl.exp2(lse - tl.max(lse, 0))  # split 0 holds key 0, so the max is finite
    dims = tl.arange(0, HEAD_DIM)
    parts = tl.load(part_out_ptr + (row * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :],
                    mask=split_valid[:, None], other=0.0)  # [SPLITS_PAD, HEAD_DIM]
    o = tl.sum(weights[:, None] * parts, 0) / tl.sum(weights, 0)
    tl.store(out_ptr + row * HEAD_DIM + dims, o.to(out_ptr.dtype.element_ty))
