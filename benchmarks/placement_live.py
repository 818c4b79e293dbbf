"""Routing and placement on real processes: `tessera up --workers N` of the demo Llama, many adapters with
Zipf popularity that drifts, each worker's adapter tiers far smaller than the adapter set, arrivals replayed
from the conv trace. Each policy gets the same requests on a freshly started system: Tessera's routing with
the registry's placement (registry/placement_planner.py), most-idle and least-loaded-with-LRU-affinity
without placement. Prints SLO attainment (TTFT and mean TPOT), the adapter hit rate (the workers' own
count: the adapter usable on the GPU tier at arrival) beside its ceiling (requests that are not their
adapter's first), and latency, per policy.

    PYTHONPATH=.:protos python benchmarks/placement_live.py --home /tmp/live --workers 4 --adapters 200
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from benchmarks.harness.cli import exits_on_sigterm, suite_parser
from benchmarks.harness.completions import Request, Result, rest_stream
from benchmarks.harness.live_system import RunningSystem, system_env, tessera_up
from benchmarks.harness.prompts import word_prompt
from benchmarks.harness.report import markdown_table, percentile, progress
from benchmarks.harness.shapes import ALL_SEVEN
from benchmarks.harness.traces import TRACE
from policy.perf_model import perf_model_path
from policy.placement import PlanLimits
from policy.simulator import cli as simulator_cli
from policy.simulator.workload import load_trace
from registry.store import RegistryStore
from services.common.adapter_layout import CONFIG_FILE, WEIGHTS_FILE
from services.common.config import load_config
from services.demo_assets import DEMO_BASE_MODEL, DemoAdapterSpec, build_llama, build_lora_adapter

RANKS = (8, 16, 32, 64)
POLICIES = ("tessera", "most-idle", "least-loaded-lru")
MAX_NUM_SEQS = 16  # each worker's


# --- the model and adapters ----------------------------------------------------------------------

def build_assets(root: Path, adapters: int, seed: int) -> tuple[Path, dict[str, Path]]:
    """The demo Llama and `adapters` real PEFT adapters on it (ranks 8-64 on all seven projections): one
    made by PEFT per rank, the others with its config and keys and their own random weights."""
    base = root / DEMO_BASE_MODEL
    if not (base / "config.json").exists():
        build_llama(base)
    templates = {}
    for rank in RANKS:
        templates[rank] = root / "templates" / f"r{rank}"
        if not (templates[rank] / WEIGHTS_FILE).exists():
            build_lora_adapter(base, templates[rank],
                               DemoAdapterSpec(f"r{rank}", rank, 2.0 * rank, ALL_SEVEN, seed=rank))
    rng = np.random.default_rng(seed)
    dirs = {}
    for i in range(adapters):
        rank = RANKS[i % len(RANKS)]
        directory = root / "adapters" / f"live-{i:03d}"
        dirs[directory.name] = directory
        if (directory / WEIGHTS_FILE).exists():
            continue
        directory.mkdir(parents=True)
        shutil.copy(templates[rank] / CONFIG_FILE, directory / CONFIG_FILE)
        tensors = load_file(templates[rank] / WEIGHTS_FILE)
        generator = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
        save_file({k: torch.randn(v.shape, generator=generator) * 0.02 for k, v in tensors.items()},
                  directory / WEIGHTS_FILE)
    return base, dirs


def register(env: dict[str, str], base: Path, adapters: dict[str, Path]) -> dict[str, int]:
    """The base model and adapters in the registry's database (idempotent); -> each of these adapters' bytes."""
    store = RegistryStore.from_config(load_config(environ=env))
    try:
        if DEMO_BASE_MODEL not in {m.name for m in store.list_base_models()}:
            store.register_base_model(DEMO_BASE_MODEL, str(base))
        known = {a.name for a in store.list_adapters()}
        for name, directory in adapters.items():
            if name not in known:
                store.register_adapter(name, DEMO_BASE_MODEL, str(directory))
        return {a.name: a.size_bytes for a in store.list_adapters() if a.name in adapters}
    finally:
        store.close()


# --- the load --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arrival:
    at_s: float
    request: Request


def arrivals(trace: Path, requests: int, rate_scale: float, adapters: list[str], skew: float, drift: float,
             drift_every_s: float, seed: int, max_prompt: int, max_output: int) -> list[Arrival]:
    """The trace's first `requests` arrivals (its clock ÷ rate_scale), each for an adapter drawn by Zipf
    rank through a ranking that reshuffles `drift` of its positions every `drift_every_s`."""
    rows = load_trace(trace, max_requests=requests)
    rng = np.random.default_rng(seed)
    weights = np.arange(1, len(adapters) + 1, dtype=np.float64) ** -skew
    ranks = rng.choice(len(adapters), size=len(rows), p=weights / weights.sum())
    ranking = rng.permutation(len(adapters))
    out, period = [], 0
    for i in range(len(rows)):
        at = float(rows.arrival_s[i]) / rate_scale
        while at >= (period + 1) * drift_every_s:
            period += 1
            moved = rng.choice(len(adapters), size=round(drift * len(adapters)), replace=False)
            ranking[moved] = ranking[rng.permutation(moved)]
        prompt = min(max_prompt, int(rows.prompt[i]))
        output = max(2, min(max_output, int(rows.output[i])))
        out.append(Arrival(at, Request(f"r{i}", word_prompt(i, prompt), adapters[ranking[ranks[i]]], output)))
    return out


@dataclass
class Timed:
    result: Result
    sent_s: float
    done_s: float = 0.0


async def replay(port: int, load: list[Arrival], timeout_s: float) -> list[Timed]:
    started = time.perf_counter()

    async def one(arrival: Arrival) -> Timed:
        await asyncio.sleep(max(0.0, arrival.at_s - (time.perf_counter() - started)))
        sent = time.perf_counter()
        result = await rest_stream(port, arrival.request, timeout_s)
        return Timed(result, sent, time.perf_counter())
    return list(await asyncio.gather(*(one(a) for a in load)))


# --- a run -------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    policy: str
    slo_attainment: float
    hit_rate: float
    hit_ceiling: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    errors: int
    planned_gpu_replicas: int = 0
    notes: list[str] = field(default_factory=list)


def role_settings(workers: int, policy: str, args: argparse.Namespace) -> dict[str, object]:
    """The roles' settings for one policy's run: `workers` workers of the demo Llama, their tiers, the SLO."""
    return {
        "GATEWAY__ROUTING_POLICY": policy,
        "GATEWAY__MAX_QUEUED_PER_MODEL": 4096,
        "GATEWAY__METADATA_REFRESH_S": 0.5,
        "REGISTRY__HEARTBEAT_INTERVAL_MS": 500,
        # Placement is Tessera's: the baselines route over the workers' own caches alone.
        "REGISTRY__PLACEMENT_INTERVAL_S": args.replan_s if policy == "tessera" else 0,
        "REGISTRY__PLACEMENT_HALF_LIFE_S": args.half_life_s,
        "REGISTRY__PLACEMENT_GPU_SHARE": args.plan_gpu_share,
        "REGISTRY__PLACEMENT_HOST_SHARE": args.plan_host_share,
        "REGISTRY__PLACEMENT_REPLICA_FACTOR": args.replica_factor,
        "LAUNCHER__WORKERS": workers,
        "WORKER__BASE_MODEL": DEMO_BASE_MODEL,
        "WORKER__CPU_LORA_WORKERS": 0,
        "WORKER__MAX_NUM_SEQS": MAX_NUM_SEQS,
        "WORKER__ADAPTER_GPU_BYTES": args.gpu_adapter_bytes,
        "WORKER__ADAPTER_HOST_BYTES": args.host_adapter_bytes,
        "WORKER__DEFAULT_TPOT_SLO_MS": args.tpot_slo_ms,
        "WORKER__DEFAULT_TTFT_SLO_MS": args.ttft_slo_ms,
        "GATEWAY__DEFAULT_TPOT_SLO_MS": args.tpot_slo_ms,
        "GATEWAY__DEFAULT_TTFT_SLO_MS": args.ttft_slo_ms,
    }


def adapter_hits(system: RunningSystem) -> tuple[int, int]:
    """(hits, misses) summed over the workers' /metrics."""
    hits = misses = 0
    first = system.port("WORKER__METRICS_PORT")
    for k in range(len(system.worker_models)):
        with urllib.request.urlopen(f"http://127.0.0.1:{first + k}/metrics", timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("tessera_worker_adapter_hits_total "):
                    hits += int(float(line.split()[1]))
                elif line.startswith("tessera_worker_adapter_misses_total "):
                    misses += int(float(line.split()[1]))
    return hits, misses


def run_policy(policy: str, home: Path, load: list[Arrival], args: argparse.Namespace) -> Outcome:
    env = system_env(home, args.workers, role_settings(args.workers, policy, args))
    with tessera_up(env, (DEMO_BASE_MODEL,) * args.workers, home / f"{policy}.log", timeout_s=300) as system:
        warm_hits, warm_misses = adapter_hits(system)  # the readiness probe's, base model: none
        progress(f"{policy}: {args.workers} workers up; replaying {len(load)} requests")
        timed = asyncio.run(replay(system.http_port, load, args.timeout_s))
        hits, misses = adapter_hits(system)
        planned = sum(len(a["workers"]) for a in system.admin("/placement-plan")["adapters"] if a["tier"] == "gpu")
    hits, misses = hits - warm_hits, misses - warm_misses
    met, ttfts, errors = 0, [], 0
    for arrival, t in zip(load, timed):
        r = t.result
        if not r.done or r.ttft_s is None:
            errors += 1
            continue
        ttfts.append(r.ttft_s)
        tpot = (t.done_s - t.sent_s - r.ttft_s) / max(1, r.tokens - 1)
        met += r.ttft_s <= args.ttft_slo_ms / 1e3 and tpot <= args.tpot_slo_ms / 1e3
    seen: set[str] = set()
    repeats = 0
    for arrival in load:
        repeats += arrival.request.model in seen
        seen.add(arrival.request.model)
    ttft_ms = (lambda q: 1e3 * percentile(ttfts, q)) if ttfts else (lambda q: float("nan"))
    return Outcome(policy, met / len(load), hits / max(1, hits + misses), repeats / len(load), ttft_ms(50),
                   ttft_ms(99), errors, planned)


def simulator_argv(args: argparse.Namespace, sizes: dict[str, int], out: Path) -> list[str]:
    """policy/simulator/cli.py's arguments for the same setting: the trace's same first requests at
    the same rate, prompt and output caps and SLO; the same workers, tiers (in the adapters' own bytes per
    rank), Zipf skew and drift (paced in trace time: the live drift period × the rate scale), the demo
    Llama's CPU performance model, the registry's plan settings (no host copies: CPU workers) and
    max_num_seqs. What it cannot model: the workers, gateway and registry sharing this machine's cores."""
    per_rank = sum(sizes.values()) / sum(RANKS[i % len(RANKS)] for i in range(len(sizes)))
    return ["--trace", str(args.trace), "--max-requests", str(args.requests), "--rate-scale", str(args.rate_scale),
            "--workers", str(args.workers), "--adapters", str(args.adapters), "--skew", str(args.skew),
            "--drift", str(args.drift), "--drift-every-min", str(args.drift_every_s * args.rate_scale / 60),
            "--rank-mix", ",".join(f"{r}:1" for r in RANKS), "--adapter-mib-per-rank", str(per_rank / 2**20),
            "--gpu-adapter-gib", f"{args.gpu_adapter_bytes / 2**30:.6f}",
            "--host-adapter-gib", f"{args.host_adapter_bytes / 2**30:.6f}", "--host-copies", "0",  # on disk at start
            "--max-batch", str(MAX_NUM_SEQS),
            "--max-prompt", str(args.max_prompt), "--max-output", str(args.max_output),
            "--tpot-slo-ms", str(args.tpot_slo_ms), "--ttft-slo-ms", str(args.ttft_slo_ms),
            "--perf-model", str(perf_model_path(f"cpu-{DEMO_BASE_MODEL}")), "--policies", args.policies,
            "--placement", "tessera", "--replan-s", str(args.replan_s), "--popularity-half-life-s",
            str(args.half_life_s), "--plan-gpu-share", str(args.plan_gpu_share), "--plan-host-share", "0",
            "--replica-factor", str(args.replica_factor), "--seed", str(args.seed), "--quiet", "--out", str(out)]


def table(outcomes: list[Outcome]) -> str:
    return markdown_table(
        ["policy", "within SLO", "adapter hit rate", "of its ceiling", "TTFT p50 / p99 ms", "errors",
         "planned GPU replicas"],
        [[o.policy, f"**{o.slo_attainment:.1%}**", f"{o.hit_rate:.1%}",
          f"{o.hit_rate / o.hit_ceiling:.3f} (ceiling {o.hit_ceiling:.1%})",
          f"{o.ttft_p50_ms:.0f} / {o.ttft_p99_ms:.0f}", str(o.errors), str(o.planned_gpu_replicas)] for o in outcomes])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = suite_parser(__doc__)
    p.add_argument("--home", type=Path, required=True, help="TESSERA_HOME of the runs (assets kept for reuse)")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--adapters", type=int, default=200)
    p.add_argument("--requests", type=int, default=400, help="the trace's first N arrivals")
    p.add_argument("--rate-scale", type=float, default=1.0, help="arrival rate × this")
    p.add_argument("--skew", type=float, default=1.1)
    p.add_argument("--drift", type=float, default=0.2, help="share of popularity ranks reshuffled per period")
    p.add_argument("--drift-every-s", type=float, default=30.0)
    p.add_argument("--max-prompt", type=int, default=96, help="prompt tokens at most (the demo model is small)")
    p.add_argument("--max-output", type=int, default=8)
    p.add_argument("--gpu-adapter-bytes", type=int, default=24 << 20, help="each worker's GPU adapter tier")
    p.add_argument("--host-adapter-bytes", type=int, default=96 << 20, help="each worker's host adapter tier")
    p.add_argument("--ttft-slo-ms", type=float, default=500.0)
    p.add_argument("--tpot-slo-ms", type=float, default=200.0)
    p.add_argument("--replan-s", type=float, default=3.0, help="Tessera's placement interval")
    p.add_argument("--half-life-s", type=float, default=60.0,
                   help="Tessera's popularity half-life (the workers' eviction half-life: planned rates weigh "
                        "against their records as like against like)")
    p.add_argument("--plan-gpu-share", type=float, default=PlanLimits.gpu_share, help="Tessera's planned GPU share")
    p.add_argument("--plan-host-share", type=float, default=PlanLimits.host_share, help="Tessera's planned host share")
    p.add_argument("--replica-factor", type=float, default=PlanLimits.replica_factor, help="Tessera's replica factor")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--simulate", action="store_true",
                   help="also print the cluster simulator's prediction for the same setting")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Outcome]:
    args = parse_args(argv)
    args.home.mkdir(parents=True, exist_ok=True)
    progress(f"building the demo Llama and {args.adapters} adapters under {args.home / 'models'}")
    base, adapter_dirs = build_assets(args.home / "models", args.adapters, args.seed)
    sizes = register(system_env(args.home, args.workers, {}), base, adapter_dirs)
    load = arrivals(args.trace, args.requests, args.rate_scale, sorted(adapter_dirs), args.skew, args.drift,
                    args.drift_every_s, args.seed, args.max_prompt, args.max_output)
    progress(f"{len(adapter_dirs)} adapters ({sum(sizes.values()) >> 20} MiB; a worker's tiers: GPU "
             f"{args.gpu_adapter_bytes >> 20} MiB, host {args.host_adapter_bytes >> 20} MiB), {len(load)} requests "
             f"over {load[-1].at_s:.0f} s, device {torch.device('cpu')} ({os.cpu_count()} cores)")
    with exits_on_sigterm():  # a `timeout` still stops the roles
        outcomes = [run_policy(policy, args.home, load, args) for policy in args.policies.split(",")]
    print(table(outcomes))
    if args.simulate:
        print("\nThe cluster simulator's prediction for the same setting:\n")
        simulator_cli.main(simulator_argv(args, sizes, args.home / "simulated"))
    return outcomes


if __name__ == "__main__":
    main()
