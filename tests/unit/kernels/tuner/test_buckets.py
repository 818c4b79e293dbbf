"""kernels.tuner.buckets: the models' projections as the engine fuses them, and the buckets a run covers."""

from __future__ import annotations

import json

import pytest

from kernels import tiling
from kernels.tiling import Bucket
from kernels.tuner.batches import MAX_GROUPS, group_lens
from kernels.tuner.buckets import PRESETS, ModelShape, buckets, model_shape, token_groups

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
    pairs = token_groups(tiling.TOKEN_POINTS)
    assert all(g <= t and len(group_lens(Bucket("shrink", 64, (32,), 16, t, g))) <= MAX_GROUPS for t, g in pairs)
    # 8192 tokens in groups of at most 32 take ~400 groups of spread sizes: never one batch.
    assert (8192, 128) in pairs and (8192, 32) not in pairs and (512, 1) not in pairs and (8, 1) in pairs
    assert token_groups([1, 32]) == [(1, 1), (32, 1), (32, 8), (32, 32)]
    assert token_groups([1, 32, 128], groups=[8, 128]) == [(32, 8), (128, 8), (128, 128)]


def test_buckets_cover_each_shape_once():
    both = buckets([LLAMA, QWEN], ["shrink", "expand"], [16, 64, 128], tiling.TOKEN_POINTS)
    per_projection = 2 * 3 * len(token_groups(tiling.TOKEN_POINTS))
    assert len(both) == len({b.key for b in both}) == 8 * per_projection
    assert buckets([LLAMA, LLAMA], ["shrink"], [16], [8]) == buckets([LLAMA], ["shrink"], [16], [8])
    restricted = buckets([QWEN], ["expand"], [64], [1, 8])
    assert {(b.op, b.block_r, b.tokens, b.group) for b in restricted} == {("expand", 64, 1, 1), ("expand", 64, 8, 1),
                                                                          ("expand", 64, 8, 8)}
    assert restricted[0] == Bucket("expand", 3584, (3584,), 64, 1, 1)  # o first: the benchmark's shape
    assert {b.out_sizes for b in buckets([QWEN], ["expand"], [64], [1], ["qkv"])} == {(3584, 512, 512)}
