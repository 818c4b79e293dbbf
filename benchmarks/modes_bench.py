"""VaLoRA's Figure 19 on Tessera (issue 41): the inference-mode policies under skewed adapter popularity.

A 7B-shaped Llama (Llama-2-7B config, random bf16 weights) with 16 rank-64 adapters on q,k,v,o, all
on the GPU; requests arrive as the shared conv trace does, scaled to --rate per second, with its prompt
and output lengths (capped); the top adapter takes `skew` of the requests and the 15 others share the
rest evenly. Policies (the worker's `mode_policy`, set on one engine between runs, on the same
requests at each skew):
  merged    merge-only: one adapter merged at a time, the next once a request of another starves
  unmerged  unmerge-only: the LoRA kernels for every step
  dlora     dLoRA's threshold switching, as VaLoRA runs it (alpha = 1, beta = 0.5)
  credit    Tessera's: VaLoRA's credit policy priced with a performance model that this benchmark
            first profiles on the device (gpu_worker/profile.py's machinery)
Every request carries the gateway's default objectives (TPOT 200 ms, TTFT 5 s), which the credits and
starvation thresholds are held to. Per skew and policy: average token latency (each request's
end-to-end latency over its output tokens, averaged over the requests), throughput (output tokens over
the time from the first arrival to the last token), steps by mode and switches; with --repeats, the
means of that many runs each, the policies' order rotated between them. Targets: credit's
average token latency <= the best of the other three at every skew; at skew >= 0.7 its throughput
>= 0.97 x merge-only's. VaLoRA's published margins are printed beside Tessera's.

    PYTHONPATH=.:protos python3 -m benchmarks.modes_bench [--skews 0.3 0.5 0.7 0.9] [--rate 8]
        [--duration-s 10] [--repeats 3] [--json OUT.json]
    PYTHONPATH=.:protos python3 -m benchmarks.modes_bench --device cpu --tiny   # CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig

from benchmarks.harness.cli import add_tiny_run_options, command_line, parse_tiny_run_args, suite_parser
from benchmarks.harness.prompts import Requests
from benchmarks.harness.report import progress, write_json
from benchmarks.harness.serving import BASE_MODEL, bench_tokenizer, replay, running_engine
from benchmarks.harness.shapes import LLAMA2_7B, TARGETS, TINY_LLAMA
from benchmarks.harness.traces import Arrival, arrivals_at_rate
from gpu_worker.builder import EngineParts, assemble_parts, async_scheduling_on
from gpu_worker.device_kind import device_name, perf_model_kind
from gpu_worker.engine import StepRecord
from gpu_worker.models.random_weights import random_llama
from gpu_worker.profile import Grid, Profiler, random_adapter_ref, random_adapters, run_grid
from policy.mode_costs import perf_model_cost
from policy.mode_policies import StepCost, make_policy
from policy.perf_model import PerfModel
from services.common.config import WorkerConfig
from services.common.runtime import freeze_startup_heap

POLICIES = ("merged", "unmerged", "dlora", "credit")
VALORA_MARGINS = {"merged": -0.33, "unmerged": -0.59, "dlora": -0.21}  # VaLoRA's token latency against each
THROUGHPUT_TARGET = 0.97  # credit over merge-only at skew >= 0.7


@dataclass(frozen=True)
class Setting:
    adapters: int = 16
    rank: int = 64
    max_num_seqs: int = 32
    max_prompt: int = 1024
    max_output: int = 128
    grid: Grid = Grid((1, 2, 4), (64, 256, 512), (1, 4, 8, 16, 32), (128, 512), (64,), 2)


SETTINGS = {"full": Setting(),
            "tiny": Setting(rank=8, max_num_seqs=8, max_prompt=64, max_output=8,
                            grid=Grid((1, 2), (8, 32), (1, 4), (16, 64), (8,), 1))}


def skewed_arrivals(trace: Path, rate: float, duration_s: float, skew: float, setting: Setting,
                    seed: int) -> list[Arrival]:
    """The conv trace's first requests at `rate` per second for `duration_s`; adapter 0 (the top one)
    with probability `skew`, else one of the others, evenly."""
    def adapters(count: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        top = rng.random(count) < skew
        return np.where(top, 0, rng.integers(1, setting.adapters, size=count))
    return arrivals_at_rate(trace, rate, duration_s, setting.max_prompt, setting.max_output, adapters)


def profiled_cost(parts: EngineParts, device: torch.device, setting: Setting) -> tuple[StepCost, PerfModel]:
    """Profile this engine's steps (unmerged, the adapters random) and fit its performance model."""
    samples = run_grid(Profiler(parts, device), setting.grid, lambda line: None)
    name = device_name(device)
    model = PerfModel.fit(perf_model_kind(name, BASE_MODEL), name, samples)
    return perf_model_cost(model), model


def summary(plan: list[Arrival], results: list[dict], steps: list[StepRecord]) -> dict:
    latencies = [r["ttft_s"] + (r["tpot_s"] or 0.0) * (r["tokens"] - 1) for r in results]
    finish = max(a.at_s + latency for a, latency in zip(plan, latencies))
    tokens = sum(r["tokens"] for r in results)
    merged = [s.merged_adapter for s in steps]
    return dict(requests=len(results), tokens=tokens,
                token_latency_ms=statistics.fmean(lat / r["tokens"] for lat, r in zip(latencies, results)) * 1e3,
                throughput_tok_s=tokens / finish, steps=dict(Counter(s.mode for s in steps)),
                switches=sum(a != b for a, b in zip([None, *merged], merged)),
                starving_max=max((s.starving for s in steps), default=0))


def averaged(rows: list[dict]) -> dict:
    """The repeats of one policy and skew: their mean (and median) token latency and throughput, and each
    run. The median shows when one run's outlier moves the mean."""
    latencies = [r["token_latency_ms"] for r in rows]
    return dict(token_latency_ms=statistics.fmean(latencies), token_latency_median_ms=statistics.median(latencies),
                throughput_tok_s=statistics.fmean(r["throughput_tok_s"] for r in rows), runs=rows)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    setting = SETTINGS["tiny" if args.tiny else "full"]
    config = LlamaConfig(**(TINY_LLAMA if args.tiny else LLAMA2_7B))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    worker = WorkerConfig(device=args.device, base_model=BASE_MODEL, max_num_seqs=setting.max_num_seqs,
                          adapter_slots=setting.adapters + max(setting.grid.decode_batches), max_lora_rank=setting.rank,
                          lora_targets=TARGETS, mode_policy="credit", cpu_lora_workers=0,
                          max_batch_tokens=max(4096, 2 * setting.max_prompt))
    model = random_llama(config, device=device, dtype=dtype)
    parts = assemble_parts(model, worker, Path("/nonexistent"), load=random_adapters(config, TARGETS, device, dtype))
    cost, perf_model = profiled_cost(parts, device, setting)
    report: dict = {"device": device_name(device), "date": datetime.date.today().isoformat(),
                    "setting": {k: v for k, v in dataclasses.asdict(setting).items() if k != "grid"},
                    "rate": args.rate, "duration_s": args.duration_s, "theta": args.theta,
                    "switch_ms": parts.orchestrator.merge_switch.switch_s * 1e3, "perf_model": perf_model.to_json()}
    progress(f"device {report['device']}; profiled: decode {perf_model.decode.form} R²={perf_model.decode.r2:.3f}, "
             f"prefill {perf_model.prefill.form} R²={perf_model.prefill.r2:.3f}; switch {report['switch_ms']:.2f} ms")
    tokenizer = bench_tokenizer(config.vocab_size)
    requests = Requests(tokenizer)
    adapters = [random_adapter_ref(f"modes-{i}", BASE_MODEL, setting.rank) for i in range(setting.adapters)]
    steps: list[StepRecord] = []
    runs: dict[str, dict] = {}
    freeze_startup_heap()
    with running_engine(parts, tokenizer, setting.rank, async_scheduling_on(WorkerConfig().async_scheduling, device),
                        on_step=steps.append) as engine:
        def replay_plan(plan: list[Arrival]) -> list[dict]:
            made = [(a.at_s, dataclasses.replace(requests.make(adapters[a.adapter], a.prompt, a.output),
                                                 tpot_slo_s=args.tpot_slo_ms / 1e3, ttft_slo_s=args.ttft_slo_ms / 1e3))
                    for a in plan]
            return asyncio.run(replay(engine, made))

        # Every adapter on the GPU before the runs (all of them fit), and the graphs and kernels warm.
        replay_plan([Arrival(0.0, i, 16, 2) for i in range(setting.adapters)])
        warm = skewed_arrivals(args.trace, args.rate, 2.0, 0.5, setting, seed=1)
        replay_plan([dataclasses.replace(a, at_s=0.0) for a in warm])
        for skew in args.skews:
            plan = skewed_arrivals(args.trace, args.rate, args.duration_s, skew, setting, seed=int(skew * 100))
            for repeat in range(args.repeats):
                for policy in POLICIES[repeat % len(POLICIES):] + POLICIES[:repeat % len(POLICIES)]:  # rotated
                    parts.orchestrator.policy = make_policy(policy, args.theta, cost)
                    steps.clear()
                    row = summary(plan, replay_plan(plan), list(steps))
                    key = f"{policy}/{skew:g}"
                    runs[key] = averaged(runs.get(key, {}).get("runs", []) + [row])
                    progress(f"{key} #{repeat + 1}: token latency {row['token_latency_ms']:.2f} ms, throughput "
                             f"{row['throughput_tok_s']:.0f} tok/s, steps {row['steps']}, switches {row['switches']}")
                    write_json(args.json, report | {"runs": runs})  # so far: a run cut short keeps it
    report["runs"] = runs
    report["comparison"] = comparison(runs, args.skews)
    return report


def comparison(runs: dict[str, dict], skews: list[float]) -> dict:
    """Per skew: credit's token latency and throughput over each other policy's, and the targets."""
    out: dict = {}
    for skew in skews:
        ours = runs[f"credit/{skew:g}"]
        others = {p: runs[f"{p}/{skew:g}"] for p in POLICIES if p != "credit"}
        latency = {p: ours["token_latency_ms"] / row["token_latency_ms"] - 1 for p, row in others.items()}
        throughput = ours["throughput_tok_s"] / others["merged"]["throughput_tok_s"]
        out[f"{skew:g}"] = dict(
            latency_vs=latency, throughput_vs_merged=throughput,
            latency_target_met=ours["token_latency_ms"] <= min(r["token_latency_ms"] for r in others.values()),
            throughput_target_met=None if skew < 0.7 else throughput >= THROUGHPUT_TARGET)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = suite_parser(__doc__)
    add_tiny_run_options(parser)
    parser.add_argument("--skews", nargs="+", type=float, default=[0.3, 0.5, 0.7, 0.9],
                        help="the top adapter's share of the requests")
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second")
    parser.add_argument("--duration-s", type=float, default=10.0, help="seconds of arrivals per run")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each policy per skew (the order rotated each time); figures are their means")
    parser.add_argument("--theta", type=float, default=WorkerConfig().mode_credit_theta)
    parser.add_argument("--tpot-slo-ms", type=float, default=200.0)
    parser.add_argument("--ttft-slo-ms", type=float, default=5000.0)
    return parse_tiny_run_args(parser, argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = run(args)
    report["command"] = command_line("benchmarks.modes_bench", argv)
    print(f"average token latency (ms) and throughput (tok/s) on {report['device']}, rate {args.rate:g}/s:")
    print("skew  " + "".join(f"{p:>22}" for p in POLICIES))
    for skew in args.skews:
        print(f"{skew:<6g}" + "".join(f"{r['token_latency_ms']:>12.2f} {r['throughput_tok_s']:>9.0f}"
                                      for r in (report["runs"][f"{p}/{skew:g}"] for p in POLICIES)))
    if args.repeats > 1:
        print("median token latency (ms) of the repeats: " + "; ".join(
            f"skew {skew:g}: " + ", ".join(f"{p} {report['runs'][f'{p}/{skew:g}']['token_latency_median_ms']:.2f}"
                                           for p in POLICIES) for skew in args.skews))
    print("credit's token latency against each (VaLoRA's published margin in brackets), throughput over merge-only:")
    for skew, row in report["comparison"].items():
        vs = ", ".join(f"{p} {row['latency_vs'][p]:+.0%} [{VALORA_MARGINS[p]:+.0%}]" for p in VALORA_MARGINS)
        met = "met" if row["latency_target_met"] else "NOT met"
        tput = "" if row["throughput_target_met"] is None else \
            f"; throughput {row['throughput_vs_merged']:.3f} [>= {THROUGHPUT_TARGET}] " \
            f"{'met' if row['throughput_target_met'] else 'NOT met'}"
        print(f"  skew {skew}: {vs}; latency target {met}{tput}", flush=True)
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
