"""kernels.tune on CPU: everything but the GPU timing itself (buckets, candidate spaces, the search
over fake timings, the correctness guard in Triton's interpreter, static configs, the table file,
the progress line and the --dry-run CLI)."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kernels import triton_lora, tuning
from kernels.batch import LoRABatch
from kernels.tune import (SHORTLIST, BatchShape, MAX_COPIES, MAX_GROUPS, MAX_TILE, MEMORY_CAP, PRESETS, STAGES, WARPS,
                          STATIONARY_MIN_GROUP, Y_PLANES_CAP,
                          BudgetSpent, CheckFailed, ModelShape,
                          Progress, Workload, batch_shapes, buckets, copy_bytes, group_lens, main, merged_table, model_shape,
                          expands_on_heuristic_splits, PIPELINE_STAGES, rotation_copies, regrets, search, segments, shrink_splits, static_configs, tile_shapes, token_groups, variants,
                          write_table)
from kernels.tuning import Bucket, ExpandConfig, ShrinkConfig

REPO = Path(__file__).resolve().parents[3]
LLAMA, QWEN = PRESETS["llama-7b"], PRESETS["qwen2-7b"]


def test_presets_give_the_projections_as_the_engine_fuses_them():
    assert LLAMA.projections() == {"qkv": (4096, (4096, 4096, 4096)), "o": (4096, (4096,)),
                                   "gate_up": (4096, (11008, 11008)), "down": (11008, (4096,))}
    assert QWEN.projections() == {"qkv": (3584, (3584, 512, 512)), "o": (3584, (3584,)),
                                  "gate_up": (3584, (18944, 18944)), "down": (18944, (3584,))}


def test_model_config_is_read_from_a_local_directory_or_file(tmp_path):
    config = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = ModelShape(hidden=2048, intermediate=5632, heads=16, kv_heads=2, head_dim=256)
    assert model_shape(str(tmp_path)) == model_shape(str(tmp_path / "config.json")) == expected
    # No head_dim (or null), no kv heads: hidden / heads, and as many kv heads as heads (HF's defaults).
    bare = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16, "head_dim": None}
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    assert model_shape(str(tmp_path / "bare.json")) == ModelShape(2048, 5632, 16, 16, 128)
    (tmp_path / "vlm.json").write_text(json.dumps({"model_type": "qwen2_vl", "text_config": config}))
    assert model_shape(str(tmp_path / "vlm.json")) == expected
    (tmp_path / "partial.json").write_text(json.dumps({"hidden_size": 2048, "num_attention_heads": 16}))
    with pytest.raises(ValueError, match="intermediate_size"):
        model_shape(str(tmp_path / "partial.json"))
    with pytest.raises(ValueError, match="preset"):
        model_shape(str(tmp_path / "missing"))


def test_token_groups_keep_at_most_max_groups_groups():
    pairs = token_groups(tuning.TOKEN_POINTS)
    assert all(g <= t and len(group_lens(Bucket("shrink", 64, (32,), 16, t, g))) <= MAX_GROUPS for t, g in pairs)
    # 8192 tokens in groups of at most 32 take ~400 groups of spread sizes: never one batch.
    assert (8192, 128) in pairs and (8192, 32) not in pairs and (512, 1) not in pairs and (8, 1) in pairs
    assert token_groups([1, 32]) == [(1, 1), (32, 1), (32, 8), (32, 32)]
    assert token_groups([1, 32, 128], groups=[8, 128]) == [(32, 8), (128, 8), (128, 128)]


def test_buckets_cover_each_shape_once():
    both = buckets([LLAMA, QWEN], ["shrink", "expand"], [16, 64, 128], tuning.TOKEN_POINTS)
    per_projection = 2 * 3 * len(token_groups(tuning.TOKEN_POINTS))
    assert len(both) == len({b.key for b in both}) == 8 * per_projection
    assert buckets([LLAMA, LLAMA], ["shrink"], [16], [8]) == buckets([LLAMA], ["shrink"], [16], [8])
    restricted = buckets([QWEN], ["expand"], [64], [1, 8])
    assert {(b.op, b.block_r, b.tokens, b.group) for b in restricted} == {("expand", 64, 1, 1), ("expand", 64, 8, 1),
                                                                          ("expand", 64, 8, 8)}
    assert restricted[0] == Bucket("expand", 3584, (3584,), 64, 1, 1)  # o first: the benchmark's shape
    assert {b.out_sizes for b in buckets([QWEN], ["expand"], [64], [1], ["qkv"])} == {(3584, 512, 512)}


def test_representative_groups_spread_below_the_largest_and_sum_to_the_tokens():
    for tokens, group in token_groups(tuning.TOKEN_POINTS):
        lens = group_lens(Bucket("expand", 64, (32,), 16, tokens, group))
        assert sum(lens) == tokens and max(lens) == lens[0] == group and min(lens) >= 1
        if tokens >= 4 * group >= 16:  # partial tiles: groups of several sizes
            assert len(set(lens)) >= 3
    assert group_lens(Bucket("shrink", 64, (32,), 16, 8, 1)) == [1] * 8  # decode: one token each


def test_representative_segments_interleave_each_groups_rows():
    lens = group_lens(Bucket("expand", 64, (32,), 16, 60, 16))
    seg_lens, seg_groups = segments(lens)
    assert [sum(n for n, g in zip(seg_lens, seg_groups) if g == i) for i in range(len(lens))] == lens
    assert all(a != b for a, b in zip(seg_groups, seg_groups[1:]))  # no group's segments touch
    batch = LoRABatch.build(seg_lens, seg_groups, "cpu")
    assert batch.rows is not None and batch.max_group_len == 16  # the kernels gather; the bucket holds
    assert segments([32]) == ([32], [0])  # one group: contiguous


def test_random_batch_shape_sums_to_the_tokens_with_the_spread_count_and_unaligned_tiles():
    for tokens, group in token_groups(tuning.TOKEN_POINTS):
        bucket = Bucket("shrink", 64, (32,), 16, tokens, group)
        shapes = batch_shapes(bucket)
        previous = tuning.TOKEN_POINTS[tuning.TOKEN_POINTS.index(group) - 1] if group > 1 else 0
        assert shapes[0].lens == group_lens(bucket) and set(shapes[0].ranks) == {16}
        assert batch_shapes(bucket) == shapes  # deterministic
        if group == 1:  # nothing to vary: one-token groups
            assert len(shapes) == 1
            continue
        spread, rand = shapes[0].lens, shapes[1].lens
        assert sum(rand) == tokens and min(rand) >= 1 and len(rand) <= MAX_GROUPS
        assert tuning.round_up(max(rand), tuning.TOKEN_POINTS) == group  # the same bucket
        if group < tokens:
            assert rand[0] == max(rand) == group
            assert len(spread) <= len(rand) <= 2 * len(spread)  # more partial tiles
        else:  # the spread batch is one group; the random one has several, the largest just in the bucket
            assert len(spread) == 1 and rand[0] == max(rand) == previous + 1 and len(rand) >= tokens / (previous + 1)
        assert shapes[2].lens == rand  # the same sizes, ranks equal then mixed
        assert shapes[1].ranks == [16] * len(rand)
        assert shapes[2].ranks[:4] == [16, 8, 4, 2][:len(rand)] and len(shapes[2].ranks) == len(rand)
        if group < tokens:  # and even batches of the fewest and the most groups the bucket allows
            assert len(shapes) == 5 and shapes[3] == BatchShape([group] * (tokens // group), [16] * (tokens // group))
            fewest, most = shapes[3].lens, shapes[4].lens
            assert len(fewest) < len(spread) and sum(most) == tokens and len(most) <= MAX_GROUPS
            assert tuning.round_up(max(most), tuning.TOKEN_POINTS) == group and len(set(most[:-1])) == 1
            assert len(most) == min(MAX_GROUPS, -(-tokens // (previous + 1))) and shapes[4].ranks == [16] * len(most)
        else:
            assert len(shapes) == 3
    # The case that motivated it: 8192 tokens in groups of <= 2048 fill 64-row tiles exactly when
    # spread, not when random.
    spread, rand = batch_shapes(Bucket("shrink", 64, (32,), 16, 8192, 2048))[:2]
    assert sum(-(-n // 64) for n in spread.lens) == 128 < sum(-(-n // 64) for n in rand.lens)


@pytest.mark.parametrize("bucket", [Bucket("shrink", 4096, (4096, 1024, 1024), 16, 1, 1),
                                    Bucket("shrink", 11008, (4096,), 128, 8192, 128),
                                    Bucket("shrink", 96, (32,), 64, 32, 8),
                                    Bucket("shrink", 4096, (4096,), 16, 2048, 2048)], ids=lambda b: b.key)
def test_shrink_candidates_respect_their_constraints(bucket):
    configs = tile_shapes(bucket)
    assert configs and len(set(configs)) == len(configs)
    top = max(16, 1 << (bucket.group - 1).bit_length())
    for c in configs:
        whole_k = c.block_k >= bucket.in_features  # a 1-row tile over all of K in one step
        if c.block_m == 1:  # CUDA-core tiles: one-token groups only, ranks spread over programs
            assert bucket.group == 1 and c.rank_block in (0, 2, 4, 8, 16)
            assert c.block_k in (128, 256, 512) or (whole_k and c.split_k == 1 and c.block_k < 2 * bucket.in_features)
            assert c.block_k * (c.rank_block or bucket.block_r) <= MAX_TILE // 2
        else:
            assert c.block_m in (16, 32, 64, 128) and min(top // 2, 32) <= c.block_m <= max(top, 64)  # wgmma: 64
            assert c.block_k in (64, 128, 256) and c.block_m * c.block_k <= MAX_TILE
            assert c.rank_block in (0, 16, 32) and c.rank_block < bucket.block_r
        assert c.split_k in (1, 2, 4, 8, 16, 32) and (bucket.in_features / c.split_k >= c.block_k or whole_k)
        assert c.split_k * bucket.tokens * len(bucket.out_sizes) * bucket.block_r * 4 <= Y_PLANES_CAP
        assert (c.num_warps, c.num_stages) == (4, 3)
    for c in configs:  # the y planes expand sums in each program: a capped tile
        assert c.split_k == 1 or c.split_k * bucket.block_r * min(bucket.group, 64) <= tuning.PLANE_TILE_CAP
    if bucket.in_features == 4096 and bucket.group == 1:  # 3 tiles (q, k, v): splits 16 and 32 fit the window
        assert {1, 16, 32} <= {c.split_k for c in configs}  # 1: whole-K 1-row tiles
        assert {c.block_m for c in configs} == {1, 16, 32, 64}  # 64: a wgmma tile
        assert ShrinkConfig(1, 4096, 1, 4, 3, rank_block=2) in configs  # whole K, unsplit
    if bucket.group == 2048:  # one long group: row tiles from 32 up, K split for parallelism
        assert {c.block_m for c in configs} == {32, 64, 128} and max(c.split_k for c in configs) == 8


@pytest.mark.parametrize("bucket", [Bucket("expand", 4096, (4096, 4096, 4096), 16, 8, 1),
                                    Bucket("expand", 3584, (3584, 512, 512), 64, 512, 128),
                                    Bucket("expand", 64, (48, 16), 16, 32, 8)], ids=lambda b: b.key)
def test_expand_candidates_respect_their_constraints(bucket):
    configs = tile_shapes(bucket)
    assert configs and len(set(configs)) == len(configs)
    top = max(16, 1 << (bucket.group - 1).bit_length())
    for c in configs:
        assert c.block_m in (1, 16, 32, 64, 128) and c.block_m <= max(top, 64)
        assert (c.block_m == 1) <= (bucket.group == 1)  # 1-row tiles only for one-token groups
        assert c.block_n in (32, 64, 128, 256) and c.n_steps in (1, 2, 4, 8)
        assert c.n_steps == 1 or c.block_n * c.n_steps // 2 < max(bucket.out_sizes)  # no all-masked steps
        if c.pipeline:  # the twin of a plain tensor-core shape of several steps
            assert c.block_m >= 16 and c.n_steps > 1 and (c.num_warps, c.num_stages) == (4, PIPELINE_STAGES[1])
            assert replace(c, num_stages=2, pipeline=False) in configs
        elif c.stationary:  # B-stationary: M spans inside the group, and 8 warps for the widest accumulators
            assert bucket.group >= max(STATIONARY_MIN_GROUP, c.block_m * c.m_steps) and c.n_steps == 1
            assert (c.num_warps, c.num_stages) == (8 if c.block_m * c.block_n >= MAX_TILE else 4, PIPELINE_STAGES[1])
        else:
            assert (c.num_warps, c.num_stages) == (4, 2)
    assert (bucket.group == 1) == any(c.block_m == 1 for c in configs)
    assert (bucket.group >= STATIONARY_MIN_GROUP) == any(c.stationary for c in configs)
    assert any(c.pipeline for c in configs) == any(c.block_m >= 16 and c.n_steps > 1 for c in configs)
    if bucket.out_sizes == (48, 16):  # slices this narrow: one step of any block_n covers them
        assert {c.n_steps for c in configs} == {1} and {c.block_m for c in configs} == {16, 32, 64}


def test_variants_cover_warps_and_stages_of_each_shortlisted_shape():
    best = [ShrinkConfig(16, 64, 8, 4, 3), ShrinkConfig(32, 128, 1, 4, 3)]
    out = variants("shrink", best)
    assert len(out) == len(set(out)) == 2 * len(WARPS) * len(STAGES["shrink"])
    assert {(c.block_m, c.block_k, c.split_k) for c in out} == {(16, 64, 8), (32, 128, 1)}
    assert {(c.num_warps, c.num_stages) for c in variants("expand", [ExpandConfig(1, 64, 4, 4, 2)])} == {
        (w, s) for w in (4, 8) for s in (1, 2)}
    pipelined = variants("expand", [ExpandConfig(16, 64, 4, 4, 3, pipeline=True)])
    assert {(c.num_warps, c.num_stages, c.pipeline) for c in pipelined} == {
        (w, s, True) for w in (4, 8) for s in PIPELINE_STAGES}


def fake_seconds(config) -> float:
    """Deterministic fake timings: bigger splits and 8 warps are faster; block_k 256 fails."""
    if getattr(config, "block_k", 0) == 256:
        raise RuntimeError("out of resource: shared memory\nmore")
    warps_stages = 0.1 * (config.num_warps == 8) + 0.01 * config.num_stages
    return 10.0 - 0.01 * config.split_k - 0.001 * config.block_k - warps_stages  # > 0: regrets are ratios


def test_search_times_the_shortlist_over_warps_and_stages_and_keeps_the_fastest():
    bucket = Bucket("shrink", 4096, (4096,), 64, 8, 1)
    measured, failures = [], []

    def measure(config):
        measured.append(config)
        return (fake_seconds(config),)  # one batch shape

    entry = search(bucket, measure, math.inf, lambda c, e: failures.append((c, str(e))))
    assert len(measured) == len(set(measured))  # nothing timed twice
    heuristic = tuning.heuristic_config(bucket)
    assert measured[0] == heuristic
    stage1 = [c for c in tile_shapes(bucket) if c.block_k != 256]
    shortlist = sorted(stage1, key=fake_seconds)[:SHORTLIST]
    assert set(measured) == {heuristic, *tile_shapes(bucket), *variants("shrink", shortlist)}
    assert {c for c, _ in failures} == {c for c in measured if c.block_k == 256}
    winner = min((c for c in measured if c.block_k != 256), key=fake_seconds)
    assert winner.num_warps == 8 and winner.num_stages == 4  # found by stage 2
    assert tuning.config_from("shrink", entry) == winner
    assert entry["us"] == round(fake_seconds(winner) * 1e6, 3) <= entry["heuristic_us"]
    assert entry["heuristic_us"] == round(fake_seconds(heuristic) * 1e6, 3)
    assert entry["regret"] == 1.0


def test_search_keeps_the_heuristic_when_nothing_beats_it_and_rejects_it_when_it_fails():
    bucket = Bucket("expand", 4096, (4096,), 16, 32, 1)
    heuristic = tuning.heuristic_config(bucket)
    entry = search(bucket, lambda c: (1.0 if c == heuristic else 2.0,), math.inf, lambda c, e: None)
    assert tuning.config_from("expand", entry) == heuristic and entry["us"] == entry["heuristic_us"] == 1e6

    def broken(config):
        if config == heuristic:
            raise RuntimeError("boom")
        return (1.0,)

    with pytest.raises(CheckFailed, match="heuristic"):
        search(bucket, broken, math.inf, lambda c, e: None)
    with pytest.raises(BudgetSpent):
        search(bucket, lambda c: (1.0,), -math.inf, lambda c, e: None)


def test_regrets_are_worst_ratios_to_each_shapes_best():
    a, b, c = (ExpandConfig(16, 64, n, 4, 2) for n in (1, 2, 4))
    assert regrets({a: (10.0, 30.0), b: (12.0, 24.0), c: (20.0, 24.0)}) == pytest.approx({a: 1.25, b: 1.2, c: 2.0})


def test_search_keeps_the_configuration_with_the_least_worst_case_regret_not_the_least_mean():
    # The first shape's times are larger, so a mean follows it; the regret weighs both shapes alike.
    bucket = Bucket("shrink", 4096, (4096,), 64, 8192, 2048)
    heuristic = tuning.heuristic_config(bucket)
    first_shape_fast, robust = [c for c in tile_shapes(bucket) if c != heuristic][:2]
    times = {first_shape_fast: (10.0, 6.0), robust: (12.0, 4.8)}  # means 8 and 8.4; regrets 1.25 and 1.2
    entry = search(bucket, lambda c: times.get(c, (30.0, 30.0)), math.inf, lambda c, e: None)
    assert tuning.config_from("shrink", entry) == robust
    assert entry["regret"] == 1.2 and entry["us"] == round(8.4 * 1e6, 3) and entry["heuristic_us"] == 30e6
    assert entry["shape_us"] == [12e6, 4.8e6]


@pytest.mark.parametrize("op", ["shrink", "expand"])
def test_workload_batches_hit_their_bucket_on_disjoint_slots(op):
    bucket = Bucket(op, 64, (32, 16), 16, 32, 8)
    work = Workload.build(bucket, copies=6, dtype=torch.float32, device="cpu")
    shapes = batch_shapes(bucket)  # spread 8, 4, 6, 2, 8, 4; random sizes twice; 4 x 8; 16 x 2
    assert len(shapes) == 5 and len(shapes[1].lens) == len(shapes[2].lens) == 12  # 32 - 8 + 1 groups at most
    assert shapes[3].lens == [8] * 4 and shapes[4].lens == [2] * 16  # even: the fewest groups, the most
    groups = 16  # slots a copy takes: the most any shape has
    assert work.stack.num_slots == 6 * groups and len(work.batches) == 6
    slots = [set(b.seg_slots) for b in work.batches]
    assert [len(s) for s in slots] == [len(shapes[c % 5].lens) for c in range(6)]
    assert all(min(s) >= c * groups and max(s) < (c + 1) * groups for c, s in enumerate(slots))  # disjoint
    assert all(tuning.bucket_of(op, work.stack, b) == bucket for b in work.batches)
    assert all(b.capacity == groups for b in work.batches)  # one compiled kernel, one grid
    assert [sorted(b.lens.tolist(), reverse=True) for b in work.batches] == [  # copies take the shapes in turn
        sorted(shapes[c % 5].lens, reverse=True) + [0] * (groups - len(shapes[c % 5].lens)) for c in range(6)]
    assert work.stack.host_ranks == [[r, r] for c in range(6)
                                     for r in [*shapes[c % 5].ranks, *[0] * (groups - len(shapes[c % 5].ranks))]]
    assert work.stack.ranks.tolist() == work.stack.host_ranks


@pytest.mark.parametrize("tokens,group", [(2048, 512), (8192, 8192), (512, 1)])
def test_mixed_rank_buckets_time_only_batches_that_mix_ranks(tokens, group):
    """Every batch shape of a mixed-rank bucket has groups of several ranks, a token-weighted mean
    under tuning.MIXED_MEAN_RANK of the rank tile, and its workload's batches look the bucket up."""
    bucket = Bucket("shrink", 64, (32,), 128, tokens, group, mixed=True)
    shapes = batch_shapes(bucket)
    plain = batch_shapes(replace(bucket, mixed=False))
    assert len(shapes) == (1 if group in (1, tokens) else 4) and len(plain) == (1 if group == 1 else 3 if group == tokens else 5)
    for shape in shapes:
        assert len(set(shape.ranks)) == min(5, len(shape.lens)) and max(shape.ranks) == 128 and min(shape.ranks) == 8
        assert shape.mean_rank < tuning.MIXED_MEAN_RANK * 128
        assert shape.lens in [p.lens for p in plain]  # the same group sizes as the unmixed bucket's
    if group < tokens:
        work = Workload.build(bucket, copies=2, dtype=torch.float32, device="cpu")
        assert all(b.mean_rank is not None and tuning.bucket_of("shrink", work.stack, b) == bucket
                   for b in work.batches)


@pytest.mark.parametrize("op", ["shrink", "expand"])
def test_check_passes_the_heuristic_in_the_interpreter(op):
    bucket = Bucket(op, 64, (32, 16), 16, 32, 8)
    Workload.build(bucket, copies=2, dtype=torch.float32, device="cpu").check(tuning.heuristic_config(bucket))


def test_check_ignores_y_past_each_adapters_rank(monkeypatch):
    bucket = Bucket("shrink", 64, (32, 16), 16, 32, 8)
    work = Workload.build(bucket, copies=3, dtype=torch.float32, device="cpu")  # the third: mixed ranks
    real = triton_lora.lora_shrink

    def garbage_past_rank(x, stack, batch, *rest):  # lora_shrink leaves those entries unspecified
        y = real(x, stack, batch, *rest)
        for start, n, slot in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots):
            y[:, start:start + n, :, stack.host_ranks[slot][0]:] = 1e6
        return y

    monkeypatch.setattr(triton_lora, "lora_shrink", garbage_past_rank)
    assert set(batch_shapes(bucket)[2].ranks) == {16, 8, 4, 2}
    work.check(tuning.heuristic_config(bucket))


def test_check_covers_every_batch_shape(monkeypatch):
    bucket = Bucket("shrink", 64, (32, 16), 16, 32, 8)
    work = Workload.build(bucket, copies=2, dtype=torch.float32, device="cpu")
    real = triton_lora.lora_shrink
    monkeypatch.setattr(triton_lora, "lora_shrink",  # wrong on the random-size batch only
                        lambda x, stack, batch, *rest: real(x, stack, batch, *rest) * (1.01 if batch is work.batches[1] else 1))
    with pytest.raises(CheckFailed, match="batch shape 1"):
        work.check(tuning.heuristic_config(bucket))


def test_check_catches_a_broken_kernel(monkeypatch):
    bucket = Bucket("shrink", 64, (32, 16), 16, 8, 8)
    work = Workload.build(bucket, copies=1, dtype=torch.float32, device="cpu")
    real = triton_lora.lora_shrink
    monkeypatch.setattr(triton_lora, "lora_shrink", lambda *args: real(*args) * 1.01)
    with pytest.raises(CheckFailed, match="off the reference"):
        work.check(tuning.heuristic_config(bucket))

    def fail(*args):
        raise RuntimeError("no smem")

    monkeypatch.setattr(triton_lora, "lora_shrink", fail)
    with pytest.raises(CheckFailed, match="no smem"):
        work.check(tuning.heuristic_config(bucket))


def test_rotation_copies_span_l2_under_the_memory_cap():
    decode = Bucket("shrink", 4096, (4096,), 16, 1, 1)
    moved, allocated = copy_bytes(decode, 2)
    assert moved == 4096 * 2 + 16 * 4096 * 2 + 16 * 2  # x, A of one slot, y (one plane: the model's dtype)
    assert copy_bytes(decode, 2, splits=4)[0] == 4096 * 2 + 16 * 4096 * 2 + 4 * 16 * 4  # float32 planes
    assert allocated == 4096 * 2 + 16 * 4096 * 2 + 4096 * 16 * 2  # x and the whole slot
    assert rotation_copies(decode, 2, needed=lambda n: 3 * 50 * 2**20 // n + 1) == MAX_COPIES  # capped
    assert rotation_copies(decode, 2, needed=lambda n: 7) == 7  # one batch shape (one-token groups)
    assert rotation_copies(Bucket("shrink", 4096, (4096,), 16, 512, 128), 2, needed=lambda n: 7) == 35  # 5 shapes
    prefill = Bucket("expand", 18944, (3584,), 128, 8192, 32)  # 256 slots of 128 x (18944 + 3584) each
    copies = rotation_copies(prefill, 2, needed=lambda n: 10**6)
    assert copies == MEMORY_CAP // copy_bytes(prefill, 2)[1] and copies * copy_bytes(prefill, 2)[1] <= MEMORY_CAP
    assert rotation_copies(prefill, 2, needed=lambda n: 1) == min(5, copies)  # each of its 5 shapes, if it can


def entry(config, us):
    return {**tuning.config_dict(config), "us": us, "heuristic_us": us * 2}


A, B = ShrinkConfig(16, 64, 1, 4, 3), ShrinkConfig(64, 128, 1, 8, 3)
SPLIT = ShrinkConfig(16, 64, 8, 4, 3)
E, ROW = ExpandConfig(16, 64, 4, 4, 3), ExpandConfig(1, 64, 4, 4, 3)


def test_static_config_wins_most_buckets_then_least_time():
    configs = {"shrink|k1|n1|r16|t1|g1": entry(A, 5.0), "shrink|k1|n1|r16|t8|g1": entry(A, 5.0),
               "shrink|k1|n1|r16|t8|g8": entry(B, 1.0), "expand|k1|n1|r16|t8|g8": entry(E, 3.0)}
    # The most wins, but 1-row tiles: one config must also run prefills, so static tiles are >= 16 rows.
    configs |= {f"expand|k1|n1|r16|t{t}|g1": entry(ROW, 1.0) for t in (1, 8)}
    assert static_configs(configs) == {"expand": tuning.config_dict(E), "shrink": tuning.config_dict(A)}
    configs["shrink|k1|n1|r16|t32|g32"] = entry(B, 1.0)  # 2 wins each: B's take less time
    assert static_configs(configs)["shrink"] == tuning.config_dict(B)
    for t in (128, 512, 2048):  # the most wins, but split: static shrink configs are unsplit
        configs[f"shrink|k1|n1|r16|t{t}|g{t}"] = entry(SPLIT, 0.5)
    assert static_configs(configs)["shrink"] == tuning.config_dict(B)
    for t in (128, 512, 2048):  # the most wins, but mixed-rank entries of shapes already counted
        configs[f"shrink|k1|n1|r16|t{t}|g{t}|mixed"] = entry(A, 0.5)
    assert static_configs(configs)["shrink"] == tuning.config_dict(B)


HEADER = {"gpu": "NVIDIA H200", "triton": "3.6.0", "torch": "2.11.0", "date": "2025-01-02",
          "command": "python -m kernels.tune --model qwen2-7b"}


def test_merge_keeps_other_buckets_and_replaces_retuned_ones():
    old = {**HEADER, "date": "2025-01-01", "command": "python -m kernels.tune --model llama-7b",
           "runs": [{"date": "2025-01-01", "command": "python -m kernels.tune --model llama-7b"}],
           "static": {}, "configs": {"shrink|k1|n1|r16|t1|g1": entry(A, 5.0), "shrink|k1|n1|r16|t8|g1": entry(A, 5.0)}}
    new = {"shrink|k1|n1|r16|t8|g1": entry(B, 1.0), "shrink|k2|n2|r16|t8|g1": entry(B, 2.0)}
    table = merged_table(old, new, HEADER)
    assert table["configs"] == {"shrink|k1|n1|r16|t1|g1": entry(A, 5.0), **new}
    assert table["static"] == {"shrink": tuning.config_dict(B)}
    assert {k: table[k] for k in HEADER} == HEADER
    assert [r["command"] for r in table["runs"]] == [old["command"], HEADER["command"]]
    fresh = merged_table(None, new, HEADER)
    assert fresh["configs"] == new and len(fresh["runs"]) == 1


def test_table_write_is_atomic(tmp_path):
    path = tmp_path / "tables" / "nvidia-h200.json"
    table = merged_table(None, {"shrink|k1|n1|r16|t1|g1": entry(A, 5.0)}, HEADER)
    write_table(path, table)
    assert json.loads(path.read_text()) == table
    with pytest.raises(TypeError):  # unserializable: the old table stays whole
        write_table(path, {**table, "bad": object()})
    assert json.loads(path.read_text()) == table
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    assert tuning.config_from("shrink", json.loads(path.read_text())["configs"]["shrink|k1|n1|r16|t1|g1"]) == A


def test_progress_shows_count_elapsed_eta_and_the_current_bucket():
    now = [100.0]
    stream = io.StringIO()
    progress = Progress(10, stream, clock=lambda: now[0])
    progress.show(0, "shrink|k1")
    now[0] += 50.0
    progress.show(5, "expand|k2")
    progress.note("skipped X")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[0/10] 0:00:00 elapsed, ETA ?  shrink|k1"
    assert lines[1] == "[5/10] 0:00:50 elapsed, ETA 0:00:50  expand|k2"
    assert lines[2] == "skipped X"


def test_dry_run_lists_buckets_and_candidate_counts(capsys, tmp_path):
    assert main(["--model", "llama-7b", "qwen2-7b", "--dry-run", "--ops", "shrink", "--ranks", "16",
                 "--tokens", "1", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 8 * 3 + 1  # 8 projections x (1,1), (8,1), (8,8); then the totals
    bucket = Bucket("shrink", 4096, (4096,), 16, 1, 1)  # o first
    stage1 = {tuning.heuristic_config(bucket), *tile_shapes(bucket)}
    assert lines[0].startswith(f"{bucket.key}  stage1 {len(stage1)}  stage2 <=")
    assert lines[-1].startswith("24 buckets (shrink 24, expand 0); timings: stage 1 ")
    # Sizing a continued run: buckets in the named table are left out.
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"configs": {"shrink|k4096|n4096+4096+4096|r16|t1|g1": entry(A, 1.0)}}))
    main(["--model", "llama-7b", "--dry-run", "--ops", "shrink", "--ranks", "16", "--tokens", "1",
          "--skip-tuned", "--table", str(table)])
    assert "n4096+4096+4096|" not in capsys.readouterr().out
    # --groups keeps the buckets of those largest-group sizes only.
    main(["--model", "llama-7b", "--dry-run", "--ops", "expand", "--ranks", "64", "--tokens", "8", "32",
          "--groups", "8", "--projections", "o"])
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines()[:-1]]
    assert keys == ["expand|k4096|n4096|r64|t8|g8", "expand|k4096|n4096|r64|t32|g8"]


def test_cli_rejects_untunable_points_and_unknown_models(capsys):
    for argv in (["--ranks", "32"], ["--tokens", "100"], ["--groups", "4"], ["--model", "no-such-model"], ["--no-merge", "--skip-tuned"]):
        with pytest.raises(SystemExit) as exc:
            main(["--model", "llama-7b", "--dry-run", *argv])
        assert exc.value.code == 2
    if not torch.cuda.is_available():
        assert main(["--model", "llama-7b", "--tokens", "1"]) == 2  # tuning needs a GPU; nothing written
    capsys.readouterr()


def test_module_entry_point_runs_the_dry_run():
    result = subprocess.run([sys.executable, "-m", "kernels.tune", "--model", "qwen2-7b", "--dry-run",
                             "--ops", "expand", "--ranks", "64", "--tokens", "1"],
                            cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.splitlines()[-1].startswith("4 buckets (shrink 0, expand 4)")


def test_expand_is_tuned_on_the_planes_its_shrink_writes():
    expand = Bucket("expand", 4096, (4096,), 16, 2048, 2048)
    shrink_key = Bucket("shrink", 4096, (4096,), 16, 2048, 2048).key
    assert shrink_splits(replace(expand, op="shrink"), None, {}) == 1  # shrink itself: no planes in
    assert shrink_splits(expand, None, {}) == tuning.heuristic_config(replace(expand, op="shrink")).split_k
    tuned = {shrink_key: {**tuning.config_dict(ShrinkConfig(64, 128, 8, 4, 3)), "us": 1.0}}
    assert shrink_splits(expand, {"configs": tuned}, {}) == 8  # from the old table
    assert shrink_splits(expand, {"configs": tuned}, {shrink_key: {**tuned[shrink_key], "split_k": 4}}) == 4
    ordered = buckets([PRESETS["llama-7b"]], ["shrink", "expand"], [16], [8])
    assert [b.op for b in ordered] == sorted(b.op for b in ordered)[::-1]  # every shrink before any expand


def test_expands_without_a_tuned_shrink_are_reported():
    shrink, expand = (Bucket(op, 4096, (4096,), 64, 512, 512) for op in ("shrink", "expand"))
    other = Bucket("expand", 4096, (4096,), 16, 512, 512)
    assert expands_on_heuristic_splits([expand, other], None) == [expand, other]
    assert expands_on_heuristic_splits([shrink, expand, other], None) == [other]  # this run tunes it
    table = {"configs": {shrink.key: tuning.config_dict(ShrinkConfig(64, 256, 2, 4, 3))}}
    assert expands_on_heuristic_splits([expand, other], table) == [other]
