"""Simulate a multi-LoRA cluster under each routing policy, driven by a real request trace.

Discrete-event, virtual time, CPU only. The workers' step times come from a perf model JSON
(policy/perf_model.py; default: a Llama-2-7B on one H200, derived from this repo's
engine benchmark), the routing from the gateway's own policy objects, each worker's adapter tiers
from the real worker's bookkeeping (`AdapterTiers`, byte budgets) with its two load stages (disk ->
host on loader threads, host -> GPU on one copy stream). Prints a markdown table per policy: SLO
attainment, TPOT and TTFT (mean, p99), GPU adapter cache hit rate, adapters' GPU memory, worker
utilisation. See docs/benchmarks/routing.md.

    PYTHONPATH=. python -m policy.simulator --workers 60 --rate-scale 8 --out /tmp/sim --plot
    PYTHONPATH=. python -m policy.simulator --sweep load --sweep-values 2,4,8,12 --out /tmp/load
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from policy.simulator import report
from policy.simulator.cluster import (EVICTIONS, ClusterConfig, PlacementConfig, RunResult, simulate,
                                      stderr_progress)
from policy.simulator.worker import WorkerConfig
from policy.simulator.workload import Popularity, adapter_ranks, build_requests, load_trace, parse_rank_mix
from policy.adapter_tiers import LoadCosts
from policy.perf_model import PerfModel
from policy.placement import PlanLimits
from policy.routing.policies import (FirstFit, LeastLoadedLRUAffinity, MostIdle, Policy,
                                     RandomChoice, RoundRobin, Slo)
from policy.routing.tessera_policy import TesseraPolicy

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO.parent / "shared" / "data" / "AzureLLMInferenceTrace_conv.csv"
DEFAULT_MODEL = REPO / "benchmarks" / "perf_models" / "h200-llama-2-7b.json"
GIB = 2**30

PolicyFactory = Callable[[argparse.Namespace, PerfModel, LoadCosts], Policy]
POLICIES: dict[str, PolicyFactory] = {
    "tessera": lambda a, m, c: TesseraPolicy({m.kind: m}, c, headroom=a.headroom,
                                             sole_holder_headroom=a.sole_holder_headroom),
    "most-idle": lambda a, m, c: MostIdle(),
    "round-robin": lambda a, m, c: RoundRobin(),
    "random": lambda a, m, c: RandomChoice(a.seed),
    "first-fit": lambda a, m, c: FirstFit(a.first_fit_batch),
    "least-loaded-lru": lambda a, m, c: LeastLoadedLRUAffinity(a.affinity_slack),
}
SWEEPS = {  # --sweep -> (argument it varies, default values)
    "load": ("rate_scale", "2,4,8,12,16,24,32,48"),
    "skew": ("skew", "0.6,0.8,1.0,1.1,1.2,1.4"),
    "workers": ("workers", "10,15,20,30,45,60,100"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Azure LLM inference trace CSV")
    p.add_argument("--perf-model", type=Path, default=DEFAULT_MODEL, help="perf model JSON of the workers")
    p.add_argument("--max-requests", type=int, help="replay only the first N requests")
    p.add_argument("--duration-min", type=float, help="replay only the first M minutes of the trace")
    p.add_argument("--rate-scale", type=float, default=8.0, help="arrival rate × this (timestamps ÷ it)")
    p.add_argument("--workers", type=int, default=60)
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--skew", type=float, default=1.1, help="Zipf exponent of adapter popularity")
    p.add_argument("--drift", type=float, default=0.2, help="fraction of popularity ranks reshuffled per period")
    p.add_argument("--drift-every-min", type=float, default=10.0, help="drift period, in trace minutes")
    p.add_argument("--rank-mix", default="8:1,16:1,32:1,64:1,128:1", help="LoRA rank:weight list")
    p.add_argument("--gpu-adapter-gib", type=float, default=WorkerConfig.gpu_adapter_bytes / GIB,
                   help="GPU adapter memory per worker (default: 32 rank-64 adapters)")
    p.add_argument("--host-adapter-gib", type=float, default=WorkerConfig.host_adapter_bytes / GIB,
                   help="pinned host adapter memory per worker (default: 128 rank-64 adapters)")
    p.add_argument("--loader-threads", type=int, default=WorkerConfig.loader_threads,
                   help="disk -> host loads a worker runs at once")
    p.add_argument("--host-copies", type=int, default=1, help="initial host copies of each adapter (0: cold start)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--kv-tokens", type=int, default=200_000)
    p.add_argument("--host-gb-per-s", type=float, default=LoadCosts.host_bytes_per_s / 1e9,
                   help="adapter copy rate host -> GPU")
    p.add_argument("--disk-gb-per-s", type=float, default=LoadCosts.disk_bytes_per_s / 1e9,
                   help="adapter load rate disk -> host, per loader thread (read, sha256, parse)")
    p.add_argument("--eviction", choices=EVICTIONS, default="lfu")
    p.add_argument("--lfu-half-life-s", type=float, default=60.0)
    p.add_argument("--tpot-slo-factor", type=float, default=1.5, help="TPOT SLO = this × the TPOT alone")
    p.add_argument("--ttft-slo-factor", type=float, default=5.0, help="TTFT SLO = this × the prefill alone")
    p.add_argument("--tpot-slo-ms", type=float, help="one TPOT SLO for every request (with --ttft-slo-ms; "
                                                     "instead of the factors)")
    p.add_argument("--ttft-slo-ms", type=float, help="one TTFT SLO for every request (with --tpot-slo-ms)")
    p.add_argument("--max-prompt", type=int, help="prompt tokens at most (benchmarks/placement_live.py's cap)")
    p.add_argument("--max-output", type=int, help="output tokens at most, 2 at least (placement_live.py's cap)")
    p.add_argument("--adapter-mib-per-rank", type=float, default=LoadCosts.bytes_per_rank / 2**20,
                   help="an adapter's bytes per unit of rank (default: q,k,v,o of a Llama-2-7B in bf16)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument("--headroom", type=float, default=0.85, help="tessera: share of the SLO its prediction may use")
    p.add_argument("--sole-holder-headroom", type=float, default=0.98,
                   help="tessera: the same share on the only worker holding the adapter on its GPU")
    p.add_argument("--first-fit-batch", type=int, default=32, help="first-fit: batch size a worker may take")
    p.add_argument("--affinity-slack", type=int, default=2, help="least-loaded-lru: load slack for affinity")
    p.add_argument("--placement", default="tessera",
                   help="comma list of the policies whose runs also place adapters by popularity (ROCK's "
                        "placement, policy/placement.py); '' for none")
    p.add_argument("--replan-s", type=float, default=30.0, help="placement: seconds between plans")
    p.add_argument("--popularity-half-life-s", type=float, default=60.0, help="placement: request rates' half-life")
    p.add_argument("--plan-gpu-share", type=float, default=PlanLimits.gpu_share,
                   help="placement: share of each GPU adapter tier the plan fills")
    p.add_argument("--plan-host-share", type=float, default=PlanLimits.host_share,
                   help="placement: share of each host adapter tier the plan fills")
    p.add_argument("--replica-factor", type=float, default=PlanLimits.replica_factor,
                   help="placement: GPU replicas per worker's worth of an adapter's traffic share")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", choices=SWEEPS, help="run a grid over one parameter, every policy per point")
    p.add_argument("--sweep-values", help="comma list for --sweep (default per sweep)")
    p.add_argument("--out", type=Path, help="write OUT.md and OUT.json (and OUT.png with --plot)")
    p.add_argument("--plot", action="store_true", help="also write a PNG (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    args = p.parse_args(argv)
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    if not 0 < args.headroom <= args.sole_holder_headroom <= 1:
        p.error("need 0 < --headroom <= --sole-holder-headroom <= 1")
    if args.plot and args.out is None:
        p.error("--plot needs --out")
    if args.sweep_values and not args.sweep:
        p.error("--sweep-values needs --sweep")
    if (args.tpot_slo_ms is None) != (args.ttft_slo_ms is None):
        p.error("--tpot-slo-ms and --ttft-slo-ms go together")
    return args


def load_costs_of(args: argparse.Namespace) -> LoadCosts:
    return LoadCosts(bytes_per_rank=round(args.adapter_mib_per_rank * 2**20),
                     host_bytes_per_s=args.host_gb_per_s * 1e9, disk_bytes_per_s=args.disk_gb_per_s * 1e9)


def run_all(args: argparse.Namespace, model: PerfModel) -> list[RunResult]:
    """Every policy on one configuration (the same requests for each)."""
    load_costs = load_costs_of(args)
    popularity = Popularity(args.adapters, args.skew, args.drift, args.drift_every_min, parse_rank_mix(args.rank_mix))
    trace = load_trace(args.trace, args.max_requests, args.duration_min).capped(
        args.max_prompt, args.max_output, min_output=1 if args.max_output is None else 2)
    fixed = Slo(args.tpot_slo_ms / 1e3, args.ttft_slo_ms / 1e3) if args.tpot_slo_ms is not None else None
    requests = build_requests(trace, popularity, args.rate_scale, model, args.tpot_slo_factor,
                              args.ttft_slo_factor, args.seed, fixed)
    worker = WorkerConfig(max_batch=args.max_batch, kv_tokens=args.kv_tokens,
                          gpu_adapter_bytes=round(args.gpu_adapter_gib * GIB),
                          host_adapter_bytes=round(args.host_adapter_gib * GIB), loader_threads=args.loader_threads)
    cluster = ClusterConfig(workers=args.workers, worker=worker, eviction=args.eviction,
                            lfu_half_life_s=args.lfu_half_life_s, host_copies=args.host_copies)
    placement = PlacementConfig(args.replan_s, args.popularity_half_life_s,
                                PlanLimits(args.plan_gpu_share, args.plan_host_share,
                                           replica_factor=args.replica_factor))
    placed = set(args.placement.split(",")) if args.placement else set()
    results = []
    for name in args.policies.split(","):
        result = simulate(requests, adapter_ranks(popularity, args.seed), POLICIES[name](args, model, load_costs),
                          model, load_costs, cluster, progress=None if args.quiet else stderr_progress,
                          placement=placement if name in placed else None)
        if not args.quiet:
            print(f"\r{name}: done in {result.wall_s:.1f} s".ljust(60), file=sys.stderr)
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        model = PerfModel.load(args.perf_model)
    except FileNotFoundError:
        raise SystemExit(f"perf model {args.perf_model} not found") from None
    command = "PYTHONPATH=. python -m " + shlex.join(["policy.simulator",
                                                   *(sys.argv[1:] if argv is None else argv)])
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config["perf_model_json"] = model.to_json()
    config["load_costs"] = asdict(load_costs_of(args))
    try:
        if args.sweep:
            parameter, default = SWEEPS[args.sweep]
            values = [float(v) for v in (args.sweep_values or default).split(",")]
            grid = {}
            for value in values:
                point = replace_arg(args, parameter, value)
                print(f"{args.sweep} = {value:g}", file=sys.stderr)
                grid[value] = run_all(point, model)
            text = report.sweep_tables(parameter, grid)
            title = f"sweep over {parameter}"
        else:
            results = run_all(args, model)
            text = report.results_table(results)
            eviction = f"LFU (half-life {args.lfu_half_life_s:g} s)" if args.eviction == "lfu" else "LRU"
            title = (f"{args.workers} workers, {args.adapters} adapters, {args.gpu_adapter_gib:g} GiB GPU / "
                     f"{args.host_adapter_gib:g} GiB host adapter memory, {args.loader_threads} loader threads, "
                     f"{eviction}, rate x{args.rate_scale:g}, skew {args.skew:g}, drift {args.drift:g}")
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        out = str(args.out)
        Path(out + ".md").write_text(f"`{command}`\n\n{title}\n\n{text}\n")
        report.write_json(Path(out + ".json"), config, grid if args.sweep else results)
        if args.plot:
            if args.sweep:
                report.plot_sweep(Path(out + ".png"), parameter, grid, title)
            else:
                report.plot_results(Path(out + ".png"), results, title)


def replace_arg(args: argparse.Namespace, name: str, value: float) -> argparse.Namespace:
    point = argparse.Namespace(**vars(args))
    setattr(point, name, int(value) if name == "workers" else value)
    return point

