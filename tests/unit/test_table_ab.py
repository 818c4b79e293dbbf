"""benchmarks/table_ab.py on CPU: which shapes two tables disagree on, and the pair ratio per shape (the
timing itself needs a GPU and is replaced here)."""

from __future__ import annotations

import pytest

from benchmarks import table_ab
from kernels.tuning import Bucket

SHAPE = "k4096|n4096|r64|t32|g1"


def test_shapes_differ_when_either_op_or_only_one_table_has_an_entry():
    old = {"configs": {f"shrink|{SHAPE}": {"split_k": 1}, f"expand|{SHAPE}": {"n_steps": 2},
                       "shrink|k4096|n4096|r16|t8|g1": {"split_k": 4}, "expand|k4096|n4096|r16|t8|g8": {"n_steps": 1}}}
    new = {"configs": {f"shrink|{SHAPE}": {"split_k": 1}, f"expand|{SHAPE}": {"n_steps": 4},
                       "shrink|k4096|n4096|r16|t8|g1": {"split_k": 4}, "expand|k4096|n4096|r16|t8|g8": {"n_steps": 1},
                       "shrink|k4096|n4096|r128|t1|g1": {"split_k": 8}}}
    assert table_ab.changed_shapes(old, new) == ["k4096|n4096|r128|t1|g1", SHAPE]
    assert table_ab.changed_shapes(old, new, match="|t32|") == [SHAPE]
    assert table_ab.changed_shapes(old, old) == []


def test_the_pair_ratio_sums_both_ops_of_each_table(monkeypatch: pytest.MonkeyPatch):
    old, new = {"configs": {}}, {"configs": {"x": 1}}
    seconds = {("shrink", False): 4e-6, ("expand", False): 6e-6, ("shrink", True): 3e-6, ("expand", True): 2e-6}
    asked = []

    def fake(bucket: Bucket, table: dict) -> float:
        asked.append(bucket)
        return seconds[(bucket.op, table is new)]

    monkeypatch.setattr(table_ab, "op_seconds", fake)
    line, pair = table_ab.compare(SHAPE, old, new)
    assert pair == pytest.approx(10 / 5)
    assert {b.key for b in asked} == {f"shrink|{SHAPE}", f"expand|{SHAPE}"}
    assert SHAPE in line and "pair old/new  2.00" in line
