"""Every suite that has a CPU-sized run, run end to end through its main([...]) with tiny arguments:
it answers every request, prints its rows and writes the JSON report it returns, and every figure in it
is a measurement. (The GPU-only suites' parts run on CPU in their own tests; served_bench starts the
system as processes, hence its integration mark.)"""

from __future__ import annotations

import csv
import datetime
import functools
import json
import math
import random
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

from benchmarks import (cold_start_bench, cold_start_replay, cpu_assist_bench, engine_loop_bench, heads_bench,
                        kernel_bench, modes_bench, served_bench, tower_bench, video_bench, vision_bench)


@dataclass(frozen=True)
class Run:
    bench: ModuleType
    report: dict      # what it wrote to --json, and returned
    out: str          # what it printed
    tmp: Path         # where it ran: --json is tmp/report.json


@dataclass(frozen=True)
class Suite:
    bench: ModuleType
    argv: Callable[[Path], list[str]]
    check: Callable[[Run], None]
    patch: Callable[[ModuleType, pytest.MonkeyPatch], None] = lambda bench, monkeypatch: None
    marks: tuple = ()


def write_trace(path: Path, requests: int = 200) -> None:
    """A conv-trace-shaped CSV: exponential gaps (2 a second), random prompt and output lengths."""
    rng, at = random.Random(0), datetime.datetime(2023, 11, 16, 18, 0, 0)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for _ in range(requests):
            at += datetime.timedelta(seconds=rng.expovariate(2.0))
            writer.writerow([at.strftime("%Y-%m-%d %H:%M:%S.%f") + "0", rng.randint(20, 3000), rng.randint(1, 300)])


def traced(tmp: Path) -> list[str]:
    """A synthetic trace's options (written under `tmp`) and the report's."""
    write_trace(tmp / "trace.csv")
    return ["--trace", str(tmp / "trace.csv"), "--json", str(tmp / "report.json")]


def figures(node: object, path: str = "") -> list[tuple[str, float]]:
    """Every number in the report with its path, except event counts (which may be 0)."""
    if isinstance(node, dict):
        return [f for key, value in node.items() if key != "counts" for f in figures(value, f"{path}.{key}")]
    if isinstance(node, list):
        return [f for i, value in enumerate(node) for f in figures(value, f"{path}[{i}]")]
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return [(path, node)]
    return []


# --- what each suite's run must show -----------------------------------------------------------

def check_cold_start_bench(run: Run) -> None:
    bench, report = run.bench, run.report
    assert [p.name for p in run.tmp.iterdir()] == ["report.json"]  # the adapter store is removed
    plan = bench.PLANS["tiny"]

    windows = report["no_stall"]
    assert set(windows) == {"a_no_loads", "b_async_loads", "a_sync_no_loads", "c_sync_loads"}
    for case, window in windows.items():
        assert window["arrivals"] == round(plan.window_s / plan.interval_s)
        assert window["tpot_p50_ms"] <= window["tpot_p99_ms"]
        # Windows (a) load nothing; (b) and (c) read new adapters from disk while the streams run.
        assert (window["counts"]["disk_loads"] > 0) == (case in ("b_async_loads", "c_sync_loads")), (case, window)

    rows = report["cold_ttft"]
    assert len(rows) == plan.lengths and all(2 <= row["length"] <= plan.max_length for row in rows)

    capacity = report["capacity"]
    assert {(row["rank"], row["adapter"].split("-")[1]) for row in capacity} == {
        (rank, targets) for rank in bench.RANKS for targets in ("qkvo", "all7")}
    for row in capacity:  # an adapter occupies at least its own bytes; a max-rank one on every target fills a slot
        assert row["true_bytes"] <= row["gpu_bytes"], row
        assert (row["true_bytes"] == row["padded_slot_bytes"]) == (row["adapter"] == "r128-all7"), row
    assert set(report["transfer"]) == {"disk_to_host_warm", "disk_to_host_dropped", "host_to_gpu"}

    assert set(report["ratios"]) >= set(bench.TARGETS)
    found = figures({k: report[k] for k in ("no_stall", "cold_ttft", "capacity", "transfer", "ratios", "tiers")})
    assert len(found) > 50
    counts = [(path, value) for path, value in found if path.endswith("compactions")]  # may be none
    assert all(value >= 0 for _, value in counts)
    measured = [figure for figure in found if figure not in counts]
    assert all(math.isfinite(value) and value > 0 for _, value in measured), [f for f in measured if not f[1] > 0]


def check_cold_start_replay(run: Run) -> None:
    bench, report = run.bench, run.report
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
    assert sorted(p.name for p in run.tmp.iterdir()) == ["report.json", "trace.csv"]  # shared files removed


def check_cpu_assist_bench(run: Run) -> None:
    bench, report = run.bench, run.report
    rows = report["rows"]
    assert {(row["rank"], row["length"]) for row in rows} == {(r, n) for r in bench.RANKS for n in report["lengths"]}
    for row in rows:  # on a CPU device an install is done when placed: the ways are told apart on a GPU
        times = [row[f"{way}_ms"] for way in (*bench.WAYS, "resident")]
        assert all(math.isfinite(t) and t > 0 for t in times), row
        assert row["fastest"] in ("pipelined", "cpu", "wait") and set(row["started"]) == {"pipelined", "cpu", "wait"}
    assert report["cpu_lora"]["ready"] == 1
    assert all(rate > 0 for rates in report["rates_tokens_per_s_one_core"].values() for rate in rates)
    assert [p.name for p in run.tmp.iterdir()] == ["report.json"]  # the shared files are removed with the engine


def check_modes_bench(run: Run) -> None:
    bench, report = run.bench, run.report
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


LOOP_NEW_TOKENS = 12


def check_engine_loop_bench(run: Run) -> None:
    bench, report = run.bench, run.report
    rows, churn = report["steps"], report["churn"]
    assert [(row["batch"], row["case"]) for row in rows] == [(b, c) for b in (1, 3) for c in bench.CASES]
    for row in rows:
        assert row["bare_ms"] > 0 and row["loop_ms"] > 0 and row["sync_ms"] > 0
        # A request decodes new_tokens - 1 steps after the prefill step that samples its first token (no EOS
        # stops it early). With every request admitted in one step, all of those steps but the last pair, less
        # the two settling ones, are timed; each later admission step loses one.
        most = LOOP_NEW_TOKENS - 1 - 1 - 2
        for timed in (row["loop_steps"], row["sync_steps"]):
            assert most - (row["batch"] - 1) <= timed <= most, row
    # Churn: every case, through both engines, 4 x 3 requests of the seeded lengths, all of their tokens.
    lengths = bench.churn_lengths(12, LOOP_NEW_TOKENS)
    assert [(c["case"], c["requests"], c["running"], c["tokens"]) for c in churn] == \
        [(case, 12, 3, sum(lengths)) for case in bench.CASES]
    assert all(c["async_tokens_per_s"] > 0 and c["sync_tokens_per_s"] > 0 for c in churn)
    assert min(lengths) >= LOOP_NEW_TOKENS // 3 and max(lengths) <= 5 * LOOP_NEW_TOKENS // 3 and len(set(lengths)) > 1


def check_vision_bench(run: Run) -> None:
    """A tiny LLaVA behind the real engine: both workloads at every concurrency level, with the caches
    (every image a cache hit, the prompt up to the question from the prefix cache) and without them."""
    vb, report = run.bench, run.report
    assert report["device"] == "cpu" and report["versions"]["torch"]
    rows = {(r["caches"], r["workload"], r["concurrency"]): r for r in report["rows"]}
    workloads = {w.name: w for w in vb.TINY.workloads}
    assert set(rows) == {(c, w, n) for c in ("on", "off") for w in workloads for n in vb.TINY.concurrency}
    tokens_per_image = (vb.TINY.config.vision_config.image_size // vb.TINY.config.vision_config.patch_size) ** 2
    for (caches, name, concurrency), row in rows.items():
        workload = workloads[name]
        assert row["requests"] >= vb.TINY.min_requests and row["requests"] % concurrency == 0
        # "USER:", the image tokens, the question, "ASSISTANT:"
        assert row["prompt_tokens"] == 1 + workload.images * tokens_per_image + workload.words + 1
        assert row["output_tokens"] == workload.max_tokens
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p90_ms"] and 0 < row["tpot_p50_ms"] <= row["tpot_p90_ms"]
        assert 0 < row["prep_p50_ms"] and row["preemptions"] == 0
        images = row["requests"] * workload.images
        if caches == "on":
            assert (row["image_hits"], row["image_misses"]) == (images, 0)
            assert row["prefix_hit_frac"] > 0.5
        else:
            assert (row["image_hits"], row["image_misses"]) == (0, images)
            assert row["prefix_hit_frac"] == 0


def check_heads_bench(run: Run) -> None:
    """A tiny LLaVA: both head kinds against generation at both concurrencies, and the streams alone and beside
    text and image classify requests; every figure measured."""
    rows = run.report["rows"]
    latency = {(r["head"], r["concurrency"]): r for r in rows if r["kind"] == "latency"}
    assert set(latency) == {(kind, n) for kind in ("mlp", "detection") for n in (1, 8)}
    for row in latency.values():
        assert 0 < row["head_p50_ms"] and 0 < row["generate_p50_ms"]
        assert row["ratio"] == pytest.approx(row["head_p50_ms"] / row["generate_p50_ms"])
    for row in rows:
        assert 0 < row["steps"] and 0 < row["step_mean_ms"] and row["prefill_steps"] <= row["steps"], row
    interference = {r["classify"]: r for r in rows if r["kind"] == "interference"}
    assert set(interference) == {"none", *run.bench.BESIDE} and interference["none"]["classify_requests"] == 0
    for name in run.bench.BESIDE:
        row = interference[name]
        assert row["classify_requests"] > 0 and 0 < row["classify_p50_ms"] <= row["classify_p99_ms"]
        assert row["tpot_ratio"] == pytest.approx(row["tpot_p50_ms"] / interference["none"]["tpot_p50_ms"])


def check_video_bench(run: Run) -> None:
    """A tiny Qwen2-VL: every level's clips answered by the head, each measured; the figure is the largest level
    within the bound."""
    vb, report = run.bench, run.report
    rows = report["rows"]
    assert [r["streams"] for r in rows] == list(vb.TINY.levels)
    for row in rows:
        assert row["clips"] == int(vb.TINY.duration_s * row["streams"]) and 0 < row["p50_ms"] <= row["p99_ms"]
        assert row["within_bound"] == (row["p99_ms"] <= vb.LATENCY_BOUND_S * 1e3)
    assert report["most_streams_within_1s"] == max((r["streams"] for r in rows if r["within_bound"]), default=0)


def check_tower_bench(run: Run) -> None:
    """A tiny LLaVA's tower: the pass without tower LoRA, then with each count of distinct adapters, each timed."""
    tb, rows = run.bench, run.report["rows"]
    assert [r["adapters"] for r in rows] == [0, *tb.TINY.adapter_counts]
    for row in rows:
        assert row["pass_ms"] > 0 and row["ratio"] == pytest.approx(row["pass_ms"] / rows[0]["pass_ms"])


KERNEL_ARGV = ["--hidden", "32", "--ranks", "mixed", "--adapters", "3", "--tokens", "1", "8"]


def on_a_fake_gpu(kb: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernel_bench's main on CPU in float32: its GPU-only calls replaced, the rest as on a GPU."""
    monkeypatch.setattr(kb, "DEVICE", "cpu")
    monkeypatch.setattr(kb, "DTYPE", torch.float32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Fake GPU")
    monkeypatch.setattr(kb.timing, "copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr(kb.timing, "copies_needed", lambda num_bytes: 2)
    monkeypatch.setattr(kb, "measure_case", functools.partial(kb.measure_case, timer=lambda calls: 1e-6))


def check_kernel_bench(run: Run) -> None:
    lines = run.out.splitlines()
    assert lines[0].startswith("Fake GPU") and "copy bandwidth 1.00 TB/s" in lines[1]
    assert sum(line.startswith("h32 mixed n3") for line in lines) == 3 * 2  # t1 decode, t8 decode and prefill
    assert sum(line.split()[:1] in (["PASS"], ["MISS"], ["n/a"]) for line in lines) == 8
    report = run.report
    assert report["complete"] and len(report["rows"]) == 6 and len(report["summary"]) == 8
    assert report["command"] == shlex.join(["python", "-m", "benchmarks.kernel_bench", *KERNEL_ARGV, "--json",
                                            str(run.tmp / "report.json")])  # what repeats this run


SERVED_MAX_TOKENS = 6


def served_argv(tmp: Path) -> list[str]:
    return ["--tiny", "--streams", "3", "5", "--max-tokens", str(SERVED_MAX_TOKENS), "--adapters", "2",
            "--home-parent", str(tmp), "--log-dir", str(tmp / "logs"), "--json", str(tmp / "report.json")]


def check_served_bench(run: Run) -> None:
    """The system as separate processes (mutual TLS on) against the same requests in-process: every
    request completed both ways and the ratios printed."""
    report = run.report
    assert report["mutual_tls"] is True and report["adapters"] == 2
    assert [row["streams"] for row in report["rows"]] == [3, 5]
    for row in report["rows"]:
        n = row["streams"]
        for how in ("served", "in_process"):
            side = row[how]
            # No EOS in the tokenizer: every request generates exactly max_tokens, through both paths.
            assert side["completed"] == n and side["all_completed"] and side["errors"] == [], (how, side)
            assert side["tokens"] == n * SERVED_MAX_TOKENS, (how, side)
            assert side["tokens_per_s"] > 0 and 0 < side["ttft_p50_ms"] <= side["ttft_p99_ms"], (how, side)
        assert row["ratio"] == pytest.approx(row["served"]["tokens_per_s"] / row["in_process"]["tokens_per_s"])
        assert f"N={n:4d}" in run.out and f"ratio {row['ratio']:.3f}" in run.out
    # Each role ran as its own process, its own log: the worker loaded the registered checkpoint, and the
    # registry's and the worker's gRPC ports spoke TLS. The temporary home is gone.
    logs = run.tmp / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["gateway.log", "registry.log", "worker.log"]
    worker_log, registry_log = (logs / "worker.log").read_text(), (logs / "registry.log").read_text()
    assert "loading bench-llama from" in worker_log and "on cpu" in worker_log
    assert ", TLS)" in worker_log and ", TLS)" in registry_log
    assert not list(run.tmp.glob("served-bench-*"))


TINY_CPU = ["--device", "cpu", "--tiny"]
CPU_LORA = ["--workers", "1", "--cores-each", "1"]
SUITES = [
    Suite(cold_start_bench, lambda tmp: [*TINY_CPU, "--store-dir", str(tmp), "--json", str(tmp / "report.json")],
          check_cold_start_bench),
    Suite(cold_start_replay, lambda tmp: [*TINY_CPU, *CPU_LORA, "--shm-dir", str(tmp), "--rates", "6",
                                          "--duration-s", "2", *traced(tmp)], check_cold_start_replay),
    Suite(cpu_assist_bench, lambda tmp: [*TINY_CPU, *CPU_LORA, "--shm-dir", str(tmp),
                                         "--json", str(tmp / "report.json")], check_cpu_assist_bench),
    Suite(modes_bench, lambda tmp: [*TINY_CPU, "--skews", "0.3", "0.9", "--rate", "6", "--duration-s", "1",
                                    "--repeats", "2", *traced(tmp)], check_modes_bench),
    Suite(engine_loop_bench, lambda tmp: ["--device", "cpu", "--batches", "1", "3", "--new-tokens",
                                          str(LOOP_NEW_TOKENS), "--steps", "3", "--json", str(tmp / "report.json")],
          check_engine_loop_bench),
    Suite(vision_bench, lambda tmp: ["--tiny", "--json", str(tmp / "report.json")], check_vision_bench),
    Suite(heads_bench, lambda tmp: ["--tiny", "--json", str(tmp / "report.json")], check_heads_bench),
    Suite(video_bench, lambda tmp: ["--tiny", "--json", str(tmp / "report.json")], check_video_bench),
    Suite(tower_bench, lambda tmp: ["--tiny", "--json", str(tmp / "report.json")], check_tower_bench),
    Suite(kernel_bench, lambda tmp: [*KERNEL_ARGV, "--json", str(tmp / "report.json")], check_kernel_bench,
          on_a_fake_gpu),
    Suite(served_bench, served_argv, check_served_bench, marks=(pytest.mark.integration,)),
]


@pytest.mark.parametrize("suite", [pytest.param(s, id=s.bench.__name__.rpartition(".")[2], marks=s.marks)
                                   for s in SUITES])
def test_a_tiny_run_reports_every_measurement(suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    suite.patch(suite.bench, monkeypatch)
    returned = suite.bench.main(suite.argv(tmp_path))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report == json.loads(json.dumps(returned))
    suite.check(Run(suite.bench, report, capsys.readouterr().out, tmp_path))
