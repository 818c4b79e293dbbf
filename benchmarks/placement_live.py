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
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from policy.simulator import cli as simulator_cli
from policy.simulator.workload import load_trace
from benchmarks.served_bench import Request, Result, prompt_text, rest_stream
from registry.store import RegistryStore
from services.common.adapter_layout import CONFIG_FILE, WEIGHTS_FILE
from services.common.config import load_config
from policy.perf_model import perf_model_path
from policy.placement import PlanLimits
from services.demo_assets import DEMO_BASE_MODEL, DemoAdapterSpec, build_llama, build_lora_adapter
from services.launcher.supervisor import stop_process_group
from tests.ports import free_port_plan

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "data" / "AzureLLMInferenceTrace_conv.csv"
RANKS = (8, 16, 32, 64)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
POLICIES = ("tessera", "most-idle", "least-loaded-lru")
MAX_NUM_SEQS = 16  # each worker's


def say(message: str) -> None:
    print(f"[placement-live] {message}", file=sys.stderr, flush=True)


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
            build_lora_adapter(base, templates[rank], DemoAdapterSpec(f"r{rank}", rank, 2.0 * rank, TARGETS, seed=rank))
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
        out.append(Arrival(at, Request(f"r{i}", prompt_text(i, prompt), adapters[ranking[ranks[i]]], output)))
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


def run_env(home: Path, workers: int, policy: str, args: argparse.Namespace) -> dict[str, str]:
    ports = free_port_plan(["REGISTRY__GRPC_PORT", "REGISTRY__ADMIN_PORT", "REGISTRY__METRICS_PORT",
                            "GATEWAY__HTTP_PORT", "GATEWAY__GRPC_PORT", "GATEWAY__METRICS_PORT"],
                           ["WORKER__GRPC_PORT", "WORKER__METRICS_PORT"], workers)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env.update({f"TESSERA_{k}": str(v) for k, v in ports.items()})
    env.update({
        "TESSERA_HOME": str(home), "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "protos")]),
        "TESSERA_GATEWAY__REGISTRY_ADDRESS": f"127.0.0.1:{ports['REGISTRY__GRPC_PORT']}",
        "TESSERA_WORKER__REGISTRY_ADDRESS": f"127.0.0.1:{ports['REGISTRY__GRPC_PORT']}",
        "TESSERA_GATEWAY__ROUTING_POLICY": policy,
        "TESSERA_GATEWAY__MAX_QUEUED_PER_MODEL": "4096",
        "TESSERA_GATEWAY__METADATA_REFRESH_S": "0.5",
        "TESSERA_REGISTRY__HEARTBEAT_INTERVAL_MS": "500",
        # Placement is Tessera's: the baselines route over the workers' own caches alone.
        "TESSERA_REGISTRY__PLACEMENT_INTERVAL_S": str(args.replan_s if policy == "tessera" else 0),
        "TESSERA_REGISTRY__PLACEMENT_HALF_LIFE_S": str(args.half_life_s),
        "TESSERA_REGISTRY__PLACEMENT_GPU_SHARE": str(args.plan_gpu_share),
        "TESSERA_REGISTRY__PLACEMENT_HOST_SHARE": str(args.plan_host_share),
        "TESSERA_REGISTRY__PLACEMENT_REPLICA_FACTOR": str(args.replica_factor),
        "TESSERA_LAUNCHER__WORKERS": str(workers),
        "TESSERA_WORKER__BASE_MODEL": DEMO_BASE_MODEL,
        "TESSERA_WORKER__CPU_LORA_WORKERS": "0",
        "TESSERA_WORKER__MAX_NUM_SEQS": str(MAX_NUM_SEQS),
        "TESSERA_WORKER__ADAPTER_GPU_BYTES": str(args.gpu_adapter_bytes),
        "TESSERA_WORKER__ADAPTER_HOST_BYTES": str(args.host_adapter_bytes),
        "TESSERA_WORKER__DEFAULT_TPOT_SLO_MS": str(args.tpot_slo_ms),
        "TESSERA_WORKER__DEFAULT_TTFT_SLO_MS": str(args.ttft_slo_ms),
        "TESSERA_GATEWAY__DEFAULT_TPOT_SLO_MS": str(args.tpot_slo_ms),
        "TESSERA_GATEWAY__DEFAULT_TTFT_SLO_MS": str(args.ttft_slo_ms),
    })
    return env


@contextmanager
def tessera_up(env: dict[str, str], log_path: Path, timeout_s: float = 300.0) -> Iterator[int]:
    """`tessera up` as a user starts it; -> the gateway's REST port once it serves the base model."""
    log = open(log_path, "w")
    process = subprocess.Popen([sys.executable, "-m", "services.cli", "up"], env=env, cwd=REPO_ROOT, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    port = int(env["TESSERA_GATEWAY__HTTP_PORT"])
    try:
        deadline = time.monotonic() + timeout_s
        probe = Request("ready", "ping", DEMO_BASE_MODEL, 1)
        while not asyncio.run(rest_stream(port, probe, 30)).done:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tessera up did not serve:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        workers = int(env["TESSERA_LAUNCHER__WORKERS"])
        while len(_workers(env)) < workers:  # every worker registered and heartbeating
            if time.monotonic() > deadline:
                raise RuntimeError("not every worker registered")
            time.sleep(0.5)
        yield port
    finally:
        stop_process_group(process, grace_s=30)
        log.close()


def _admin(env: dict[str, str], path: str) -> dict:
    key = (Path(env["TESSERA_HOME"]) / "admin_api_key").read_text().strip()
    request = urllib.request.Request(f"http://127.0.0.1:{env['TESSERA_REGISTRY__ADMIN_PORT']}/admin/v1{path}",
                                     headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _workers(env: dict[str, str]) -> list[dict]:
    return [w for w in _admin(env, "/workers")["workers"] if w["healthy"]]


def _adapter_hits(env: dict[str, str], workers: int) -> tuple[int, int]:
    """(hits, misses) summed over the workers' /metrics."""
    hits = misses = 0
    first = int(env["TESSERA_WORKER__METRICS_PORT"])
    for k in range(workers):
        with urllib.request.urlopen(f"http://127.0.0.1:{first + k}/metrics", timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("tessera_worker_adapter_hits_total "):
                    hits += int(float(line.split()[1]))
                elif line.startswith("tessera_worker_adapter_misses_total "):
                    misses += int(float(line.split()[1]))
    return hits, misses


def run_policy(policy: str, home: Path, load: list[Arrival], args: argparse.Namespace) -> Outcome:
    env = run_env(home, args.workers, policy, args)
    with tessera_up(env, home / f"{policy}.log") as port:
        warm_hits, warm_misses = _adapter_hits(env, args.workers)  # the readiness probe's, base model: none
        say(f"{policy}: {args.workers} workers up; replaying {len(load)} requests")
        timed = asyncio.run(replay(port, load, args.timeout_s))
        hits, misses = _adapter_hits(env, args.workers)
        planned = sum(len(a["workers"]) for a in _admin(env, "/placement-plan")["adapters"] if a["tier"] == "gpu")
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
    quantile = (lambda q: 1e3 * float(np.quantile(ttfts, q))) if ttfts else (lambda q: float("nan"))
    return Outcome(policy, met / len(load), hits / max(1, hits + misses), repeats / len(load), quantile(0.5),
                   quantile(0.99), errors, planned)


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
    rows = ["| policy | within SLO | adapter hit rate | of its ceiling | TTFT p50 / p99 ms | errors | planned GPU replicas |",
            "|---|---|---|---|---|---|---|"]
    rows += [f"| {o.policy} | **{o.slo_attainment:.1%}** | {o.hit_rate:.1%} | {o.hit_rate / o.hit_ceiling:.3f} "
             f"(ceiling {o.hit_ceiling:.1%}) | {o.ttft_p50_ms:.0f} / {o.ttft_p99_ms:.0f} | {o.errors} "
             f"| {o.planned_gpu_replicas} |" for o in outcomes]
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--home", type=Path, required=True, help="TESSERA_HOME of the runs (assets kept for reuse)")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
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
    say(f"building the demo Llama and {args.adapters} adapters under {args.home / 'models'}")
    base, adapter_dirs = build_assets(args.home / "models", args.adapters, args.seed)
    env = run_env(args.home, args.workers, "tessera", args)
    sizes = register(env, base, adapter_dirs)
    load = arrivals(args.trace, args.requests, args.rate_scale, sorted(adapter_dirs), args.skew, args.drift,
                    args.drift_every_s, args.seed, args.max_prompt, args.max_output)
    say(f"{len(adapter_dirs)} adapters ({sum(sizes.values()) >> 20} MiB; a worker's tiers: GPU "
        f"{args.gpu_adapter_bytes >> 20} MiB, host {args.host_adapter_bytes >> 20} MiB), {len(load)} requests over "
        f"{load[-1].at_s:.0f} s, device {torch.device('cpu')} ({os.cpu_count()} cores)")
    outcomes = [run_policy(policy, args.home, load, args) for policy in args.policies.split(",")]
    print(table(outcomes))
    if args.simulate:
        print("\nThe cluster simulator's prediction for the same setting:\n")
        simulator_cli.main(simulator_argv(args, sizes, args.home / "simulated"))
    return outcomes


if __name__ == "__main__":
    main()
