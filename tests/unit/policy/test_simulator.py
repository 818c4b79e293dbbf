"""policy/simulator/cli.py and policy/simulator/: trace reading, the popularity model,
one request's timing worked out by hand, determinism, and Tessera against most-idle when the
GPU adapter cache is far smaller than the adapter set. Synthetic traces only (no ../shared needed)."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from policy.simulator import cli as simulator_cli
from policy.simulator.cluster import ClusterConfig, PlacementConfig, simulate
from policy.simulator.worker import WorkerConfig
from policy.simulator.workload import Popularity, SimRequest, adapter_ranks, build_requests, load_trace
from policy.adapter_tiers import LoadCosts, Tier
from policy.batch_summary import BatchEntry, BatchSummary
from policy.perf_model import PerfModel
from policy.routing.policies import MostIdle, Slo
from policy.routing.tessera_policy import TesseraPolicy

MODEL = PerfModel.load(Path(simulator_cli.DEFAULT_MODEL))
MIB, GIB = 2**20, 2**30
UNIFORM_RANKS = {8: 1.0, 16: 1.0, 32: 1.0, 64: 1.0, 128: 1.0}


def write_trace(path: Path, requests: int, per_s: float, seed: int = 0) -> Path:
    """An Azure-format CSV (7-digit fractions, like the real one): Poisson arrivals."""
    rng = random.Random(seed)
    t = datetime(2023, 11, 16, 18, 0, 0)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for _ in range(requests):
        t += timedelta(seconds=rng.expovariate(per_s))
        lines.append(f"{t:%Y-%m-%d %H:%M:%S}.{t.microsecond:06d}0,{rng.randint(50, 2000)},{rng.randint(8, 300)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_trace_reading_and_its_errors(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,396,0\n"
                    "2023-11-16 18:17:51.0000000,879,55\n")
    trace = load_trace(path)
    assert trace.arrival_s.tolist() == pytest.approx([0.0, 4.314579, 124.31941])
    assert trace.output.tolist() == [44, 1, 55]      # a request yields at least its first token
    assert len(load_trace(path, max_requests=2)) == 2
    assert len(load_trace(path, duration_min=1.0)) == 2
    with pytest.raises(FileNotFoundError, match="--trace"):
        load_trace(tmp_path / "missing.csv")
    (tmp_path / "bad.csv").write_text("time,prompt\n1,2\n")
    with pytest.raises(ValueError, match="expected columns"):
        load_trace(tmp_path / "bad.csv")


def test_popularity_is_heavy_tailed_and_drifts_only_when_asked(tmp_path: Path) -> None:
    trace = load_trace(write_trace(tmp_path / "t.csv", 3000, per_s=5.0))   # ~10 minutes
    def top_per_period(drift: float) -> list[str]:
        popularity = Popularity(100, 1.1, drift, drift_every_min=2.0, rank_mix=UNIFORM_RANKS)
        requests = build_requests(trace, popularity, 1.0, MODEL, 1.5, 5.0, seed=3)
        periods: dict[int, Counter] = {}
        for r in requests:
            periods.setdefault(int(r.arrival_s // 120), Counter())[r.adapter] += 1
        full = [c for _, c in sorted(periods.items()) if sum(c.values()) >= 300]  # not the last, partial one
        return [c.most_common(1)[0][0] for c in full]
    steady = top_per_period(0.0)
    assert len(steady) >= 4 and len(set(steady)) == 1
    assert len(set(top_per_period(1.0))) > 1
    popularity = Popularity(100, 1.1, 0.0, 2.0, UNIFORM_RANKS)
    counts = Counter(r.adapter for r in build_requests(trace, popularity, 1.0, MODEL, 1.5, 5.0, seed=3))
    assert sum(n for _, n in counts.most_common(5)) / len(trace) > 0.4   # top 5% of adapters: > 40%


def test_adapter_ranks_are_the_ones_requests_carry(tmp_path: Path) -> None:
    trace = load_trace(write_trace(tmp_path / "t.csv", 500, per_s=5.0))
    popularity = Popularity(40, 1.1, 0.2, 1.0, UNIFORM_RANKS)
    ranks = adapter_ranks(popularity, seed=5)
    assert sorted(ranks) == sorted(popularity.names()) and set(ranks.values()) <= set(UNIFORM_RANKS)
    assert all(ranks[r.adapter] == r.rank for r in build_requests(trace, popularity, 1.0, MODEL, 1.5, 5.0, seed=5))


def test_inputs_are_validated() -> None:
    with pytest.raises(ValueError, match="drift"):
        Popularity(10, 1.1, 1.5, 10.0, UNIFORM_RANKS)
    with pytest.raises(ValueError, match="rank mix"):
        Popularity(10, 1.1, 0.1, 10.0, {0: 1.0})
    with pytest.raises(ValueError, match="host"):
        WorkerConfig(gpu_adapter_bytes=2 * GIB, host_adapter_bytes=GIB)
    rank8 = LoadCosts().adapter_bytes(8)
    small = WorkerConfig(gpu_adapter_bytes=4 * rank8, host_adapter_bytes=8 * rank8)
    with pytest.raises(ValueError, match="host adapter memory"):   # 50 adapters a worker, room for 8
        simulate([], {f"a{i}": 8 for i in range(100)}, MostIdle(), MODEL, LoadCosts(),
                 ClusterConfig(workers=2, worker=small))
    with pytest.raises(ValueError, match="does not fit"):          # rank 64 is 8 rank-8 adapters' bytes
        simulate([], {"a0": 64}, MostIdle(), MODEL, LoadCosts(), ClusterConfig(workers=2, worker=small))


def test_one_request_takes_its_load_prefill_and_decode_steps_by_the_model() -> None:
    prompt, output, rank = 1000, 50, 64
    req = SimRequest(0, 0.0, prompt, output, "a0", rank, Slo(1.0, 1.0))
    costs = LoadCosts()
    result = simulate([req], {"a0": rank}, MostIdle(), MODEL, costs, ClusterConfig(workers=1, host_copies=1))
    load = costs.load_s(Tier.HOST, rank)                       # staged in host memory
    prefill = MODEL.prefill_s(BatchSummary.of([BatchEntry("a0", rank, prompt)]))
    assert result.ttft_mean_s == pytest.approx(load + prefill)
    steps = [MODEL.decode_s(BatchSummary.of([BatchEntry("a0", rank, prompt + k)])) for k in range(1, output)]
    assert result.tpot_mean_s == pytest.approx(sum(steps) / (output - 1))
    assert result.hit_rate == 0.0 and result.slo_attainment == 1.0
    assert result.utilisation == pytest.approx((prefill + sum(steps)) / (load + prefill + sum(steps)))


def test_a_cold_request_waits_for_the_disk_stage_then_the_copy() -> None:
    prompt, output, rank = 500, 2, 32
    req = SimRequest(0, 0.0, prompt, output, "a0", rank, Slo(1.0, 1.0))
    costs = LoadCosts()
    result = simulate([req], {"a0": rank}, MostIdle(), MODEL, costs, ClusterConfig(workers=1, host_copies=0))
    nbytes = rank * 2 * MIB                                    # 20 ms + read at 1.5 GB/s, 0.5 ms + copy at 25 GB/s
    load = 20e-3 + nbytes / 1.5e9 + 0.5e-3 + nbytes / 25e9
    prefill = MODEL.prefill_s(BatchSummary.of([BatchEntry("a0", rank, prompt)]))
    assert result.ttft_mean_s == pytest.approx(load + prefill)


def small_cluster(tmp_path: Path) -> tuple[list[SimRequest], dict[str, int], ClusterConfig]:
    """50 adapters, 4 workers with GPU memory for 4 rank-64 adapters each: about a third of the adapters."""
    trace = load_trace(write_trace(tmp_path / "t.csv", 600, per_s=6.0))
    popularity = Popularity(50, 1.1, 0.2, drift_every_min=0.5, rank_mix=UNIFORM_RANKS)
    requests = build_requests(trace, popularity, 1.0, MODEL, 1.5, 5.0, seed=1)
    rank64 = LoadCosts().adapter_bytes(64)
    config = ClusterConfig(workers=4, worker=WorkerConfig(gpu_adapter_bytes=4 * rank64, host_adapter_bytes=16 * rank64))
    return requests, adapter_ranks(popularity, seed=1), config


def test_small_run_is_deterministic_and_tessera_beats_most_idle(tmp_path: Path) -> None:
    requests, adapters, config = small_cluster(tmp_path)
    costs = LoadCosts()
    def run(policy):
        return dataclasses.replace(simulate(requests, adapters, policy, MODEL, costs, config), wall_s=0.0)
    tessera = run(TesseraPolicy({MODEL.kind: MODEL}, costs, headroom=0.85))
    assert tessera == run(TesseraPolicy({MODEL.kind: MODEL}, costs, headroom=0.85))
    most_idle = run(MostIdle())
    assert tessera.requests == most_idle.requests == 600
    assert tessera.slo_attainment > most_idle.slo_attainment
    assert tessera.hit_rate > most_idle.hit_rate
    assert 0 < tessera.gpu_adapter_gb <= 4 * costs.adapter_bytes(64) / 1e9    # never over the budget


def test_cli_writes_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = write_trace(tmp_path / "t.csv", 200, per_s=4.0)
    out = tmp_path / "run"
    simulator_cli.main(["--trace", str(trace), "--workers", "3", "--adapters", "30", "--gpu-adapter-gib", "0.5",
                           "--host-adapter-gib", "2", "--loader-threads", "1",
                           "--policies", "tessera,most-idle,first-fit", "--quiet", "--out", str(out)])
    printed = capsys.readouterr().out
    for policy in ("tessera", "most-idle", "first-fit"):
        assert f"| {policy} |" in printed
    markdown = Path(f"{out}.md").read_text()
    assert markdown.startswith("`PYTHONPATH=. python -m policy.simulator --trace")
    data = json.loads(Path(f"{out}.json").read_text())
    assert [r["policy"] for r in data["results"]] == ["tessera", "most-idle", "first-fit"]
    assert data["config"]["perf_model_json"]["kind"] == MODEL.kind
    assert "0.5 GiB GPU / 2 GiB host adapter memory" in markdown and data["config"]["loader_threads"] == 1


def test_a_live_runs_setting_caps_prompts_and_outputs_fixes_the_slo_and_sizes_adapters(tmp_path: Path) -> None:
    """What benchmarks/placement_live.py's runs are simulated with: its prompt and output caps, one
    absolute SLO for every request, and the demo adapters' bytes per rank."""
    trace = load_trace(write_trace(tmp_path / "t.csv", 100, per_s=4.0)).capped(96, 8, min_output=2)
    assert trace.prompt.max() <= 96 and 2 <= trace.output.min() and trace.output.max() <= 8
    popularity = Popularity(20, 1.1, 0.2, drift_every_min=2.0, rank_mix=UNIFORM_RANKS)
    requests = build_requests(trace, popularity, 4.0, MODEL, 1.5, 5.0, seed=0, fixed_slo=Slo(0.2, 0.5))
    assert {r.slo for r in requests} == {Slo(0.2, 0.5)}
    args = simulator_cli.parse_args(["--adapter-mib-per-rank", "0.0707", "--tpot-slo-ms", "200",
                                        "--ttft-slo-ms", "500"])
    assert simulator_cli.load_costs_of(args).adapter_bytes(64) == 64 * round(0.0707 * MIB)
    with pytest.raises(SystemExit):
        simulator_cli.parse_args(["--tpot-slo-ms", "200"])  # one without the other


def test_cli_rejects_a_missing_trace(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="not found"):
        simulator_cli.main(["--trace", str(tmp_path / "none.csv"), "--quiet"])


def test_placement_runs_deterministically_within_the_tiers_and_the_hit_ceiling(tmp_path: Path) -> None:
    """ROCK's placement in the simulator: plans every few seconds, enacted as preloads within each tier's
    budget; the same inputs give the same run, and no run hits more than the ceiling."""
    requests, adapters, config = small_cluster(tmp_path)
    costs = LoadCosts()
    placement = PlacementConfig(every_s=5.0, half_life_s=20.0)

    def run(placed: bool):
        return dataclasses.replace(simulate(requests, adapters, TesseraPolicy({MODEL.kind: MODEL}, costs), MODEL,
                                            costs, config, placement=placement if placed else None), wall_s=0.0)
    placed, routed = run(True), run(False)
    assert placed == run(True)
    assert placed.placement_moves > 0 and routed.placement_moves == 0
    ceiling = 1 - len({r.adapter for r in requests}) / len(requests)
    assert placed.hit_ceiling == routed.hit_ceiling == pytest.approx(ceiling)
    assert routed.hit_rate <= ceiling and placed.hit_rate <= ceiling
    assert 0 < placed.gpu_adapter_gb <= 4 * costs.adapter_bytes(64) / 1e9
    assert placed.requests == 600 and placed.slo_attainment > 0.5
