"""benchmarks/cpu_assist_bench.py's smoke run (tiny model, CPU): every cell has each way's TTFT and the
resident one, all measured. (On a CPU device an install is done when placed, so no request starts
cold: the ways are told apart on a GPU.)"""

from __future__ import annotations

import json
import math

from benchmarks import cpu_assist_bench as bench


def test_smoke_run_reports_every_cell(tmp_path):
    out = tmp_path / "report.json"
    report = bench.main(["--device", "cpu", "--tiny", "--workers", "1", "--cores-each", "1",
                         "--shm-dir", str(tmp_path), "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    rows = report["rows"]
    assert {(row["rank"], row["length"]) for row in rows} == {(r, n) for r in bench.RANKS for n in report["lengths"]}
    for row in rows:
        times = [row[f"{way}_ms"] for way in (*bench.WAYS, "resident")]
        assert all(math.isfinite(t) and t > 0 for t in times), row
        assert row["fastest"] in ("pipelined", "cpu", "wait") and set(row["started"]) == {"pipelined", "cpu", "wait"}
    assert report["cpu_lora"]["ready"] == 1
    assert all(rate > 0 for rates in report["rates_tokens_per_s_one_core"].values() for rate in rates)
    assert list(tmp_path.iterdir()) == [out]  # the shared files are removed with the engine
