"""benchmarks/cold_start_replay.py's smoke run (tiny model, CPU, a synthetic trace): every policy's run
answers every request, the cached runs find every adapter on the GPU, and from disk the first
requests of each adapter miss; every figure is a measurement."""

from __future__ import annotations

import csv
import datetime
import json
import math
import random

from benchmarks import cold_start_replay as bench


def write_trace(path, requests: int = 200) -> None:
    rng, at = random.Random(0), datetime.datetime(2023, 11, 16, 18, 0, 0)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for _ in range(requests):
            at += datetime.timedelta(seconds=rng.expovariate(2.0))
            writer.writerow([at.strftime("%Y-%m-%d %H:%M:%S.%f") + "0", rng.randint(20, 3000), rng.randint(1, 300)])


def test_smoke_run_reports_every_policy(tmp_path):
    trace, out = tmp_path / "trace.csv", tmp_path / "report.json"
    write_trace(trace)
    report = bench.main(["--device", "cpu", "--tiny", "--workers", "1", "--cores-each", "1", "--shm-dir",
                         str(tmp_path), "--rates", "6", "--duration-s", "2", "--trace", str(trace), "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    requests = report["plans"]["6.0"]["requests"]
    runs = report["runs"]
    assert set(runs) == {"cached/cached/6"} | {f"{way}/{source}/6" for way in bench.WAYS for source in ("host", "disk")}
    for key, row in runs.items():
        assert row["requests"] == requests == row["gpu_hits"] + row["gpu_misses"], key
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms")), key
    assert runs["cached/cached/6"]["gpu_misses"] == 0
    beyond = report["plans"]["6.0"]["beyond_gpu"]  # adapters not among the most popular on the GPU at the start
    assert beyond and all(runs[f"{way}/{source}/6"]["gpu_misses"] >= beyond  # each one's first request
                          for way in bench.WAYS for source in ("host", "disk"))
    assert set(report["ratios"]) == {f"{way}/{source}" for way in bench.WAYS for source in ("host", "disk")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "trace.csv"]  # shared files removed
