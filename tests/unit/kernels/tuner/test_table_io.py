"""kernels.tuner.table_io: static configurations, the merged table, the atomic write, and what the
table holds already."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kernels import tiling
from kernels.tiling import Bucket, ExpandConfig, ShrinkConfig
from kernels.tuner.buckets import PRESETS, buckets
from kernels.tuner.table_io import (expands_on_heuristic_splits, merged_table, shrink_splits, static_configs,
                                    write_table)


def entry(config, us):
    return {**tiling.config_dict(config), "us": us, "heuristic_us": us * 2}


A, B = ShrinkConfig(16, 64, 1, 4, 3), ShrinkConfig(64, 128, 1, 8, 3)
SPLIT = ShrinkConfig(16, 64, 8, 4, 3)
E, ROW = ExpandConfig(16, 64, 4, 4, 3), ExpandConfig(1, 64, 4, 4, 3)


def test_static_config_wins_most_buckets_then_least_time():
    configs = {"shrink|k1|n1|r16|t1|g1": entry(A, 5.0), "shrink|k1|n1|r16|t8|g1": entry(A, 5.0),
               "shrink|k1|n1|r16|t8|g8": entry(B, 1.0), "expand|k1|n1|r16|t8|g8": entry(E, 3.0)}
    # The most wins, but 1-row tiles: one config must also run prefills, so static tiles are >= 16 rows.
    configs |= {f"expand|k1|n1|r16|t{t}|g1": entry(ROW, 1.0) for t in (1, 8)}
    assert static_configs(configs) == {"expand": tiling.config_dict(E), "shrink": tiling.config_dict(A)}
    configs["shrink|k1|n1|r16|t32|g32"] = entry(B, 1.0)  # 2 wins each: B's take less time
    assert static_configs(configs)["shrink"] == tiling.config_dict(B)
    for t in (128, 512, 2048):  # the most wins, but split: static shrink configs are unsplit
        configs[f"shrink|k1|n1|r16|t{t}|g{t}"] = entry(SPLIT, 0.5)
    assert static_configs(configs)["shrink"] == tiling.config_dict(B)
    for t in (128, 512, 2048):  # the most wins, but mixed-rank entries of shapes already counted
        configs[f"shrink|k1|n1|r16|t{t}|g{t}|mixed"] = entry(A, 0.5)
    assert static_configs(configs)["shrink"] == tiling.config_dict(B)


HEADER = {"gpu": "NVIDIA H200", "triton": "3.6.0", "torch": "2.11.0", "date": "2025-01-02",
          "command": "python -m kernels.tuner --model qwen2-7b"}


def test_merge_keeps_other_buckets_and_replaces_retuned_ones():
    old = {**HEADER, "date": "2025-01-01", "command": "python -m kernels.tuner --model llama-7b",
           "runs": [{"date": "2025-01-01", "command": "python -m kernels.tuner --model llama-7b"}],
           "static": {}, "configs": {"shrink|k1|n1|r16|t1|g1": entry(A, 5.0), "shrink|k1|n1|r16|t8|g1": entry(A, 5.0)}}
    new = {"shrink|k1|n1|r16|t8|g1": entry(B, 1.0), "shrink|k2|n2|r16|t8|g1": entry(B, 2.0)}
    table = merged_table(old, new, HEADER)
    assert table["configs"] == {"shrink|k1|n1|r16|t1|g1": entry(A, 5.0), **new}
    assert table["static"] == {"shrink": tiling.config_dict(B)}
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
    assert tiling.config_from("shrink", json.loads(path.read_text())["configs"]["shrink|k1|n1|r16|t1|g1"]) == A


def test_expand_is_tuned_on_the_planes_its_shrink_writes():
    expand = Bucket("expand", 4096, (4096,), 16, 2048, 2048)
    shrink_key = Bucket("shrink", 4096, (4096,), 16, 2048, 2048).key
    assert shrink_splits(replace(expand, op="shrink"), None, {}) == 1  # shrink itself: no planes in
    assert shrink_splits(expand, None, {}) == tiling.heuristic_config(replace(expand, op="shrink")).split_k
    tuned = {shrink_key: {**tiling.config_dict(ShrinkConfig(64, 128, 8, 4, 3)), "us": 1.0}}
    assert shrink_splits(expand, {"configs": tuned}, {}) == 8  # from the old table
    assert shrink_splits(expand, {"configs": tuned}, {shrink_key: {**tuned[shrink_key], "split_k": 4}}) == 4
    ordered = buckets([PRESETS["llama-7b"]], ["shrink", "expand"], [16], [8])
    assert [b.op for b in ordered] == sorted(b.op for b in ordered)[::-1]  # every shrink before any expand


def test_expands_without_a_tuned_shrink_are_reported():
    shrink, expand = (Bucket(op, 4096, (4096,), 64, 512, 512) for op in ("shrink", "expand"))
    other = Bucket("expand", 4096, (4096,), 16, 512, 512)
    assert expands_on_heuristic_splits([expand, other], None) == [expand, other]
    assert expands_on_heuristic_splits([shrink, expand, other], None) == [other]  # this run tunes it
    table = {"configs": {shrink.key: tiling.config_dict(ShrinkConfig(64, 256, 2, 4, 3))}}
    assert expands_on_heuristic_splits([expand, other], table) == [other]
