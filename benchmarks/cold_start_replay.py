"""Cold starts under load, CaraServe's setting (issue 40), on a 7B-shaped Llama (Llama-2-7B config, random
bf16 weights), one GPU and its host's cores: 512 rank-64 adapters on q,k,v with Zipf-skewed popularity,
a GPU adapter tier that holds 64 of them, arrivals and prompt/output lengths replayed from the shared
conv trace scaled to 3, 6 and 9 requests/s. Policies, one run each per rate and source, on the same
requests:
  cached     every adapter the run asks for is resident before it starts (a GPU tier that holds them all)
  wait       on-demand loading: a request waits until its whole adapter is on the GPU
  pipelined  layer-pipelined loading alone (policy/cold_start.py)
  cpu        CPU assistance alone: the CPU LoRA workers until the adapter is usable on the GPU
  auto       Tessera's policy: the fastest way that keeps running requests within the TPOT objective
Before a run, the GPU tier holds the 64 most popular adapters (a popularity-driven tier's steady
state) and, by source, the host tier every other adapter the run asks for (`host`) or none of them
(`disk`: an adapter's first request reads it).
Each run gets its own adapters (new digests; their weights share one file, hard-linked). Reported per
run: mean and p99 TTFT, mean TPOT, and how its cold requests started; against `cached` at the same
rate, the TTFT and TPOT ratios (targets: auto <= 1.07 and <= 1.03).

    PYTHONPATH=.:protos python3 -m benchmarks.cold_start_replay [--sources host disk] [--rates 3 6 9]
        [--duration-s 15] [--workers 4] [--cores-each 3] [--json OUT.json]
    PYTHONPATH=.:protos python3 -m benchmarks.cold_start_replay --device cpu --tiny   # CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig

from benchmarks.harness.adapter_files import AdapterShape, AdapterStore, adapter_bytes
from benchmarks.harness.cli import (add_cpu_lora_options, add_tiny_run_options, command_line, parse_tiny_run_args,
                                    suite_parser)
from benchmarks.harness.prompts import Requests
from benchmarks.harness.report import percentile, progress, write_json
from benchmarks.harness.serving import BASE_MODEL, bench_tokenizer, replay, running_engine
from benchmarks.harness.shapes import LLAMA2_7B, QKV, TINY_LLAMA
from benchmarks.harness.traces import Arrival, arrivals_at_rate
from gpu_worker.builder import EngineParts, assemble_parts, async_scheduling_on
from gpu_worker.engine import Engine
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.models.random_weights import random_llama
from services.common.config import WorkerConfig
from services.common.runtime import freeze_startup_heap

WAYS = ("wait", "pipelined", "cpu", "auto")  # the worker's cold_start_policy values, on one engine
TARGETS = {"ttft": 1.07, "tpot": 1.03}        # auto over cached (issue 40)


@dataclass(frozen=True)
class Setting:
    adapters: int = 512
    gpu_adapters: int = 64
    rank: int = 64
    skew: float = 1.0          # Zipf exponent of adapter popularity
    max_prompt: int = 2048
    max_output: int = 128


SETTINGS = {"full": Setting(), "tiny": Setting(adapters=32, gpu_adapters=4, rank=8, max_prompt=96, max_output=8)}


def arrivals(trace: Path, rate: float, duration_s: float, setting: Setting, seed: int) -> list[Arrival]:
    """The conv trace's first requests at `rate` per second for `duration_s`; each request's adapter drawn
    by Zipf popularity (Arrival.adapter: its popularity rank)."""
    weights = 1.0 / np.arange(1, setting.adapters + 1) ** setting.skew
    return arrivals_at_rate(trace, rate, duration_s, setting.max_prompt, setting.max_output, lambda count: (
        np.random.default_rng(seed).choice(setting.adapters, size=count, p=weights / weights.sum())))


def summary(results: list[dict], started: dict[str, int], hits: int, misses: int) -> dict:
    ttfts = [r["ttft_s"] * 1e3 for r in results]
    tpots = [r["tpot_s"] * 1e3 for r in results if r["tpot_s"] is not None]
    return dict(requests=len(results), ttft_mean_ms=statistics.fmean(ttfts), ttft_p50_ms=percentile(ttfts, 50),
                ttft_p99_ms=percentile(ttfts, 99), tpot_mean_ms=statistics.fmean(tpots),
                tpot_p99_ms=percentile(tpots, 99), cold_starts=started, gpu_hits=hits, gpu_misses=misses)


class Runs:
    """One engine's runs: each on fresh adapters, from `source`, under a cold-start way."""

    def __init__(self, engine: Engine, parts: EngineParts, store: AdapterStore, tokenizer_requests: Requests,
                 setting: Setting) -> None:
        self.engine, self.parts, self.store, self.requests, self.setting = engine, parts, store, tokenizer_requests, setting

    def run(self, plan: list[Arrival], way: str, source: str) -> dict:
        shape, popular = AdapterShape(self.setting.rank, QKV), range(self.setting.gpu_adapters)
        asked = sorted({a.adapter for a in plan})
        refs: dict[int, AdapterRef] = {index: self.store.new(shape).ref for index in sorted({*asked, *popular})}
        self.parts.scheduler.cold_start.policy = "pipelined"
        if source == "cached":
            asyncio.run(self._touch([refs[index] for index in asked]))
            resident = set(self.engine.stats().adapters.gpu_adapters)
            assert resident >= {refs[index].name for index in asked}, "the cached GPU tier must hold every adapter"
        else:
            # The steady state of a popularity-driven GPU tier: the most popular adapters there (touched last),
            # from `host` every other adapter of the run in host memory too.
            others = [refs[index] for index in asked if index not in popular] if source == "host" else []
            asyncio.run(self._touch(others + [refs[index] for index in popular]))
        self.parts.scheduler.cold_start.policy = way
        requests = [(a.at_s, self.requests.make(refs[a.adapter], a.prompt, a.output)) for a in plan]
        before = self.engine.stats()
        results = asyncio.run(replay(self.engine, requests))
        after = self.engine.stats()
        started = {k: after.cold_starts_total.get(k, 0) - before.cold_starts_total.get(k, 0)
                   for k in after.cold_starts_total}
        return summary(results, started, after.adapters.hits - before.adapters.hits,
                       after.adapters.misses - before.adapters.misses)

    async def _touch(self, refs: list[AdapterRef]) -> None:
        """A one-token request on each adapter, a few at a time: read into the host tier, and onto the GPU."""
        loop = asyncio.get_running_loop()

        async def one(ref: AdapterRef) -> None:
            async for _ in self.engine.submit(self.requests.make(ref, 8, 1), loop):
                pass
        for first in range(0, len(refs), 8):
            await asyncio.gather(*(one(ref) for ref in refs[first:first + 8]))


def worker_config(args: argparse.Namespace, setting: Setting, config: LlamaConfig, dtype: torch.dtype,
                  gpu_adapters: int, host_adapters: int) -> WorkerConfig:
    one = adapter_bytes(config, AdapterShape(setting.rank, QKV), torch.empty((), dtype=dtype).element_size())
    return WorkerConfig(device=args.device, base_model=BASE_MODEL, max_num_seqs=64, adapter_gpu_bytes=gpu_adapters * one,
                        adapter_host_bytes=host_adapters * one, adapter_eviction="lru", max_lora_rank=setting.rank,
                        lora_targets=list(QKV), mode_policy="unmerged", max_batch_tokens=max(4096, 2 * setting.max_prompt),
                        cpu_lora_workers=args.workers, cpu_lora_cores_each=args.cores_each,
                        cpu_lora_shm_dir=args.shm_dir)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    setting = SETTINGS["tiny" if args.tiny else "full"]
    config = LlamaConfig(**(TINY_LLAMA if args.tiny else LLAMA2_7B))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    plans = {rate: arrivals(args.trace, rate, args.duration_s, setting, seed=int(rate * 1000)) for rate in args.rates}
    popular = set(range(setting.gpu_adapters))
    distinct = max(len({a.adapter for a in plan} | popular) for plan in plans.values())
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "date": datetime.date.today().isoformat(), "setting": setting.__dict__, "rates": args.rates,
                    "duration_s": args.duration_s, "sources": args.sources, "workers": args.workers,
                    "cores_each": args.cores_each,
                    "plans": {str(rate): dict(requests=len(plan), distinct_adapters=len({a.adapter for a in plan}),
                                              beyond_gpu=len({a.adapter for a in plan} - popular),
                                              requests_beyond_gpu=sum(a.adapter not in popular for a in plan))
                              for rate, plan in plans.items()}}
    progress(f"device: {report['device']}; {setting}; plans {report['plans']}")
    tokenizer = bench_tokenizer(config.vocab_size)
    requests = Requests(tokenizer)
    model = random_llama(config, device=device, dtype=dtype)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="cold-start-replay-") as tmp:
        store = AdapterStore(Path(tmp), config, BASE_MODEL, dtype, device)
        engines = [("cached", ["cached"], distinct + 8), ("tiers", WAYS, setting.gpu_adapters)]
        for label, ways, gpu_adapters in engines:
            # The host tier holds a run's adapters and the run before's: a run's reads never wait for room.
            parts = assemble_parts(model, worker_config(args, setting, config, dtype, gpu_adapters,
                                                        max(gpu_adapters, 2 * distinct + 8)), store.root)
            progress(f"engine '{label}' ready: GPU tier {parts.adapters.stats().gpu_capacity_bytes / 2**30:.2f} GiB")
            freeze_startup_heap()
            with running_engine(parts, tokenizer, setting.rank, async_scheduling_on(WorkerConfig().async_scheduling,
                                                                                    device)) as engine:
                runner = Runs(engine, parts, store, requests, setting)
                runner.run(plans[args.rates[0]][:8], "auto", "host")  # warm-up: graphs, kernel variants
                for rate in args.rates:
                    for source in (["cached"] if label == "cached" else args.sources):
                        for way in ways:
                            key = f"{way}/{source}/{rate:g}"
                            runs[key] = runner.run(plans[rate], "auto" if way == "cached" else way, source)
                            row = runs[key]
                            write_json(args.json, report | {"runs": runs})  # so far: a run cut short keeps it
                            progress(f"{key}: TTFT mean {row['ttft_mean_ms']:.1f} ms (p99 {row['ttft_p99_ms']:.1f}), "
                                     f"TPOT mean {row['tpot_mean_ms']:.2f} ms; started {row['cold_starts']}; GPU "
                                     f"hits {row['gpu_hits']}, misses {row['gpu_misses']}")
            del parts, engine, runner
            gc.unfreeze()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report["runs"] = runs
    report["ratios"] = ratios(runs, args.rates, args.sources)
    return report


def ratios(runs: dict[str, dict], rates: list[float], sources: list[str]) -> dict:
    """Each way's mean TTFT and TPOT over cached's at the same rate, and their means over the rates."""
    out: dict = {}
    for source in sources:
        for way in WAYS:
            per_rate = {}
            for rate in rates:
                row, cached = runs[f"{way}/{source}/{rate:g}"], runs[f"cached/cached/{rate:g}"]
                per_rate[f"{rate:g}"] = dict(ttft=row["ttft_mean_ms"] / cached["ttft_mean_ms"],
                                             tpot=row["tpot_mean_ms"] / cached["tpot_mean_ms"])
            out[f"{way}/{source}"] = dict(per_rate=per_rate, **{
                measure: statistics.fmean(r[measure] for r in per_rate.values()) for measure in ("ttft", "tpot")})
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = suite_parser(__doc__)
    add_tiny_run_options(parser)
    add_cpu_lora_options(parser)
    parser.add_argument("--sources", nargs="+", choices=("host", "disk"), default=["host", "disk"])
    parser.add_argument("--rates", nargs="+", type=float, default=[3.0, 6.0, 9.0], help="requests per second")
    parser.add_argument("--duration-s", type=float, default=15.0, help="seconds of arrivals per run")
    return parse_tiny_run_args(parser, argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = run(args)
    report["command"] = command_line("benchmarks.cold_start_replay", argv)
    print("mean TTFT / mean TPOT over cached (mean over the rates; per rate in the JSON):")
    for key, value in report["ratios"].items():
        marks = f" (targets <= {TARGETS['ttft']} / <= {TARGETS['tpot']})" if key.startswith("auto/") else ""
        print(f"  {key:<16} {value['ttft']:.3f} / {value['tpot']:.3f}{marks}", flush=True)
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
