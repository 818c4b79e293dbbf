"""benchmarks/modes_bench.py's smoke run (tiny model, CPU, a synthetic trace): every policy answers every
request at every skew, the merge-only runs merge, the unmerge-only runs never do, and every figure is a
measurement."""

from __future__ import annotations

import json
import math

from benchmarks import modes_bench as bench
from tests.unit.test_cold_start_replay import write_trace


def test_smoke_run_reports_every_policy_at_every_skew(tmp_path):
    trace, out = tmp_path / "trace.csv", tmp_path / "report.json"
    write_trace(trace)
    report = bench.main(["--device", "cpu", "--tiny", "--skews", "0.3", "0.9", "--rate", "6", "--duration-s", "1",
                         "--repeats", "2", "--trace", str(trace), "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    runs = report["runs"]
    assert set(runs) == {f"{policy}/{skew}" for policy in bench.POLICIES for skew in ("0.3", "0.9")}
    for key, row in runs.items():
        assert len(row["runs"]) == 2 and all(r["requests"] == 6 for r in row["runs"]), key
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("token_latency_ms", "throughput_tok_s")), key
    assert all("unmerged" not in r["steps"] for r in runs["merged/0.9"]["runs"])
    assert all(set(r["steps"]) == {"unmerged"} and r["switches"] == 0 for r in runs["unmerged/0.3"]["runs"])
    assert set(report["comparison"]) == {"0.3", "0.9"}
    assert report["comparison"]["0.3"]["throughput_target_met"] is None  # judged at skew >= 0.7 only
    assert report["switch_ms"] > 0 and report["perf_model"]["decode"]["samples"] > 0
