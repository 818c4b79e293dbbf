"""The tuned-table lookup: bucket keys from host ints, table entries, heuristic fallback."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import NO_SLOT, LoRABatch, LoRAStack, tiling
from kernels.tiling import Bucket, ExpandConfig, ShrinkConfig


def stack(max_rank: int = 64, out_sizes: tuple[int, ...] = (4096, 1024, 1024)) -> LoRAStack:
    return LoRAStack.standalone(2, 4096, out_sizes, max_rank, torch.float16, "meta")


def batch(seg_lens, seg_slots, **kwargs) -> LoRABatch:
    return LoRABatch.build(seg_lens, seg_slots, "cpu", **kwargs)


@pytest.mark.parametrize("value,expected", [(0, 1), (1, 1), (2, 8), (8, 8), (9, 32), (2049, 8192), (10**6, 8192)])
def test_round_up_to_the_next_tuned_point(value, expected):
    assert tiling.round_up(value, tiling.TOKEN_POINTS) == expected


def test_bucket_of_rounds_shape_rank_tokens_and_group():
    decode = batch([1] * 20, list(range(20)))  # 20 tokens, one per adapter
    key = tiling.bucket_of("shrink", stack(max_rank=48), decode)
    assert key == Bucket("shrink", 4096, (4096, 1024, 1024), 64, 32, 1)
    grouped = batch([1] * 20, [0, 1] * 10)  # scattered: groups of 10
    assert tiling.bucket_of("expand", stack(max_rank=16), grouped) == Bucket("expand", 4096, (4096, 1024, 1024), 16, 32, 32)
    # A graph's bound on the group size counts, but never beyond the batch's tokens.
    loose = batch([4], [0], max_group_len=100)
    assert tiling.bucket_of("shrink", stack(), loose).group == 8
    assert tiling.bucket_of("shrink", stack(), batch([5], [NO_SLOT])).group == 1


@pytest.mark.parametrize("bucket", [Bucket("shrink", 4096, (4096, 1024, 1024), 64, 32, 1),
                                    Bucket("expand", 3584, (18944, 18944), 128, 8192, 512, mixed=True)])
def test_a_key_names_its_bucket(bucket):
    assert Bucket.from_key(bucket.key) == bucket


@pytest.mark.parametrize("key", ["shrink|k4096|n4096|r64|t32", "merge|k4096|n4096|r64|t32|g1",
                                 "expand|k4096|nfoo|r64|t32|g1", "expand|k4096|n4096|r64|t32|g1|mixd",
                                 "expand|4096|n4096|r64|t32|g1"])
def test_a_malformed_key_is_refused(key):
    with pytest.raises(ValueError, match="not a bucket key"):
        Bucket.from_key(key)


def test_lookup_prefers_the_table_and_falls_back_to_the_heuristic():
    bucket = Bucket("shrink", 4096, (4096,), 64, 32, 1)
    tuned = ShrinkConfig(block_m=16, block_k=256, split_k=16, num_warps=8, num_stages=4)
    table = {"configs": {bucket.key: {**tiling.config_dict(tuned), "us": 3.0}}, "static": {}}
    assert tiling.lookup(bucket, table) == tuned
    other = Bucket("shrink", 4096, (4096,), 64, 128, 1)
    assert tiling.lookup(other, table) == tiling.heuristic_config(other)
    older = {k: v for k, v in tiling.config_dict(tuned).items() if k != "rank_block"}  # tables before the field
    assert tiling.config_from("shrink", older) == tuned
    assert tiling.lookup(Bucket("expand", 4096, (4096,), 64, 32, 1), table) == tiling.heuristic_config(
        Bucket("expand", 4096, (4096,), 64, 32, 1))


def test_a_batch_known_to_mix_ranks_gets_its_own_entry_else_the_unmixed_one():
    """Mean rank (over tokens) under half the batch's largest: the mixed-rank bucket, whose entry
    the lookup prefers, falling back to the same bucket's entry without the mix, then the heuristic."""
    lens, slots = [300, 900, 500], [0, 1, 0]
    mixed = tiling.bucket_of("shrink", stack(max_rank=128), batch(lens, slots, max_rank=128, mean_rank=44.0))
    assert mixed == Bucket("shrink", 4096, (4096, 1024, 1024), 128, 2048, 2048, mixed=True)
    assert mixed.key.endswith("|mixed")
    for mean in (None, 64.0, 128.0):  # unknown, or half the largest rank and more: not mixed
        assert not tiling.bucket_of("shrink", stack(max_rank=128), batch(lens, slots, max_rank=128, mean_rank=mean)).mixed
    plain = Bucket("shrink", 4096, (4096, 1024, 1024), 128, 2048, 2048)
    assert plain.key == mixed.key.removesuffix("|mixed")
    uniform_cfg = ShrinkConfig(block_m=128, block_k=128, split_k=1, num_warps=8, num_stages=3)
    mixed_cfg = ShrinkConfig(block_m=64, block_k=128, split_k=1, num_warps=4, num_stages=3, rank_block=32)
    table = {"configs": {plain.key: tiling.config_dict(uniform_cfg)}, "static": {}}
    assert tiling.lookup(mixed, table) == uniform_cfg
    table["configs"][mixed.key] = tiling.config_dict(mixed_cfg)
    assert tiling.lookup(mixed, table) == mixed_cfg and tiling.lookup(plain, table) == uniform_cfg
    assert tiling.lookup(mixed, {"configs": {}, "static": {}}) == tiling.heuristic_config(mixed)
    with pytest.raises(AssertionError):  # a mean above the bound is a caller's bug
        batch(lens, slots, max_rank=16, mean_rank=20.0)


def test_heuristics_cover_every_bucket_with_valid_configs():
    for op in ("shrink", "expand"):
        for rank in tiling.RANK_POINTS:
            for tokens in tiling.TOKEN_POINTS:
                for group in (g for g in tiling.TOKEN_POINTS if g <= tokens):
                    config = tiling.heuristic_config(Bucket(op, 3584, (3584, 512, 512), rank, tokens, group))
                    assert config.num_warps in (1, 2, 4, 8) and config.num_stages >= 1
                    if isinstance(config, ShrinkConfig):  # y planes: a power of 2 (3584 // 512 is 7)
                        assert config.block_m >= 1 and config.block_k >= 16 and config.split_k in (1, 2, 4, 8, 16)
                    else:
                        assert isinstance(config, ExpandConfig) and config.block_n >= 16 and config.n_steps >= 1


def test_table_file_is_found_by_gpu_name(tmp_path, monkeypatch):
    entry = {"block_m": 1, "block_n": 64, "n_steps": 2, "num_warps": 4, "num_stages": 3, "us": 2.5}
    static = {"block_m": 32, "block_n": 128, "n_steps": 1, "num_warps": 4, "num_stages": 2}
    (tmp_path / "nvidia-h200.json").write_text(json.dumps(
        {"gpu": "NVIDIA H200", "configs": {"expand|k4096|n4096|r64|t8|g1": entry}, "static": {"expand": static}}))
    monkeypatch.setattr(tiling, "TABLE_DIR", tmp_path)
    tiling.load_table.cache_clear()
    try:
        assert tiling.gpu_slug("NVIDIA H200") == "nvidia-h200"
        table = tiling.load_table("NVIDIA H200")
        assert tiling.lookup(Bucket("expand", 4096, (4096,), 64, 8, 1), table) == ExpandConfig(1, 64, 2, 4, 3)
        assert tiling.load_table("Some Other GPU")["configs"] == {}
    finally:
        tiling.load_table.cache_clear()


def _write_table(directory, gpu: str, capability: str, configs: dict, static: dict) -> None:
    table = {"gpu": gpu, "capability": capability, "configs": configs, "static": static}
    (directory / f"{tiling.gpu_slug(gpu)}.json").write_text(json.dumps(table))


def test_a_gpu_without_its_own_entries_runs_those_of_its_architecture(tmp_path, monkeypatch):
    """An H100 takes an H200's entries for the buckets its own table lacks; a GPU of another
    architecture takes none of them (their tiles may not even fit its shared memory)."""
    decode, prefill = Bucket("expand", 4096, (4096,), 64, 8, 1), Bucket("expand", 4096, (4096,), 64, 2048, 2048)
    kin_decode = {"block_m": 1, "block_n": 64, "n_steps": 2, "num_warps": 4, "num_stages": 3}
    own_decode = {"block_m": 1, "block_n": 128, "n_steps": 4, "num_warps": 8, "num_stages": 2}
    kin_prefill = {"block_m": 32, "block_n": 128, "n_steps": 4, "num_warps": 4, "num_stages": 3}
    kin_static = {"expand": kin_prefill, "shrink": {"block_m": 64, "block_k": 128, "split_k": 1, "num_warps": 4,
                                                   "num_stages": 4}}
    _write_table(tmp_path, "NVIDIA H200", "9.0", {decode.key: kin_decode, prefill.key: kin_prefill}, kin_static)
    monkeypatch.setattr(tiling, "TABLE_DIR", tmp_path)
    tiling.load_table.cache_clear()
    try:
        h100 = tiling.load_table("NVIDIA H100 80GB HBM3", "9.0")  # no table of its own yet
        assert h100["sources"] == ["NVIDIA H200"]
        assert tiling.lookup(decode, h100) == ExpandConfig(1, 64, 2, 4, 3)
        assert h100["static"] == kin_static

        _write_table(tmp_path, "NVIDIA H100 80GB HBM3", "9.0", {decode.key: own_decode},
                     {"expand": own_decode})
        tiling.load_table.cache_clear()
        h100 = tiling.load_table("NVIDIA H100 80GB HBM3", "9.0")
        assert h100["sources"] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
        assert tiling.lookup(decode, h100) == ExpandConfig(1, 128, 4, 8, 2)  # its own entry wins
        assert tiling.lookup(prefill, h100) == ExpandConfig(32, 128, 4, 4, 3)  # the sibling's fills the gap
        assert h100["static"] == {**kin_static, "expand": own_decode}

        ampere = tiling.load_table("NVIDIA A100-SXM4-80GB", "8.0")
        assert ampere["sources"] == [] and ampere["configs"] == {}
        assert tiling.lookup(decode, ampere) == tiling.heuristic_config(decode)
    finally:
        tiling.load_table.cache_clear()


def test_the_committed_tables_name_their_architecture():
    for path in tiling.TABLE_DIR.glob("*.json"):
        table = json.loads(path.read_text())
        assert path.name == f"{tiling.gpu_slug(table['gpu'])}.json"
        major, minor = table["capability"].split(".")
        assert major.isdigit() and minor.isdigit()


def test_cpu_tensors_use_no_table_and_a_static_config_exists():
    assert tiling.table_for(torch.device("cpu"))["configs"] == {}
    assert isinstance(tiling.static_config("shrink", torch.device("cpu")), ShrinkConfig)
    assert isinstance(tiling.static_config("expand", torch.device("cpu")), ExpandConfig)
