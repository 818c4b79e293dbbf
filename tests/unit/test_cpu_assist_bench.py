"""benchmarks/cpu_assist_bench.py's smoke run (tiny model, CPU): every cell's requests ran on the CPU LoRA
workers while the GPU tier was held, and every figure is a measurement."""

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
    for row in rows:  # the warm request and the timed ones: all CPU-assisted, while the blocker held the GPU
        assert row["cpu_assisted_requests"] == 1 + bench.REPEATS, row
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("cpu_ms", "resident_ms", "cpu_over_resident"))
    assert report["cpu_lora"]["jobs"] > 0 and report["cpu_lora"]["ready"] == 1
    assert all(rate > 0 for rates in report["rates_tokens_per_s_one_core"].values() for rate in rates)
    assert list(tmp_path.iterdir()) == [out]  # the shared files are removed with the engine
