"""The cold-start ways (issue 40; policy/cold_start.py) on a 7B-shaped Llama (Llama-2-7B config,
random bf16 weights), one GPU and its host's cores: the TTFT of a request whose adapter is in host memory,
not on the GPU, started (a) layer-pipelined while its copy onto the GPU runs, (b) with its LoRA on the
CPU LoRA workers until the adapter is usable on the GPU (CaraServe), (c) once the whole adapter is on
the GPU, and (d) as the `auto` policy chooses, against (e) the same request once its adapter is
resident; a base-model stream runs beside it throughout. Over prompt lengths from the shared conv
trace and ranks 8-128 on q,k,v (CaraServe's targets): the map of which way wins by (length, rank) is
the policy's evidence. The GPU adapter tier holds one adapter of the largest size: a 1-token request
on a blocker adapter of that size puts the measured adapter back in host memory before each cold
request. Adapters are real PEFT files (benchmarks/harness/adapter_files.py).

    PYTHONPATH=.:protos python3 -m benchmarks.cpu_assist_bench [--workers 4] [--cores-each 3] [--json OUT.json]
    PYTHONPATH=.:protos python3 -m benchmarks.cpu_assist_bench --device cpu --tiny   # CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import statistics
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig

from benchmarks.harness.adapter_files import AdapterShape, AdapterStore, adapter_bytes
from benchmarks.harness.cli import add_cpu_lora_options, add_tiny_run_options, parse_tiny_run_args, suite_parser
from benchmarks.harness.prompts import Requests
from benchmarks.harness.report import progress, write_json
from benchmarks.harness.serving import BASE_MODEL, bench_tokenizer, first_token_s, running_engine
from benchmarks.harness.shapes import ALL_SEVEN, LLAMA2_7B, QKV, TINY_LLAMA
from benchmarks.harness.traces import LENGTH_CAP, prompt_lengths
from gpu_worker.builder import assemble_parts, async_scheduling_on
from gpu_worker.engine import Engine
from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.models.random_weights import random_llama
from policy.cold_start import ColdStartPolicy
from services.common.config import WorkerConfig
from services.common.cpu_lora.shm import RATE_RANKS, RATES
from services.common.runtime import freeze_startup_heap

RANKS = (8, 32, 128)
REPEATS = 3
HOLD_TOKENS = 2048  # the holding streams decode this long at most (the model's context allowing): longer than a cell


async def _started(engine: Engine, request: GenerationRequest) -> asyncio.Task:
    """Submit `request` and return once it has a token (it is running), draining it in the background."""
    outputs = aiter(engine.submit(request, asyncio.get_running_loop()))
    await anext(outputs)

    async def drain() -> None:
        async for _ in outputs:
            pass
    return asyncio.create_task(drain())


WAYS = ("pipelined", "cpu", "wait", "auto")  # cold_start_policy values, each measured on its own


async def cell(engine: Engine, policy: ColdStartPolicy, requests: Requests, blocker: AdapterRef, adapter: AdapterRef,
               length: int, hold_tokens: int) -> dict:
    """TTFT (medians of REPEATS, ms) of `adapter` at `length` prompt tokens started each way from host
    memory, and resident, a base-model stream beside it; how the cold requests started (engine stats)."""
    stream = requests.make(None, 16, hold_tokens)
    beside = await _started(engine, stream)
    await first_token_s(engine, requests.make(adapter, 8, 1))  # disk -> host (and onto the GPU)
    before = dict(engine.stats().cold_starts_total)
    row: dict = dict(length=length, rank=adapter.rank)
    for way in WAYS:
        times = []
        for _ in range(REPEATS):
            policy.policy = "pipelined"
            await first_token_s(engine, requests.make(blocker, 8, 1))  # takes the whole GPU tier: `adapter` leaves
            assert adapter.name not in engine.stats().adapters.gpu_adapters, "the blocker did not evict it"
            policy.policy = way
            times.append(await first_token_s(engine, requests.make(adapter, length, 1)))
        row[f"{way}_ms"] = statistics.median(times) * 1e3
    row["resident_ms"] = statistics.median([await first_token_s(engine, requests.make(adapter, length, 1))
                                            for _ in range(REPEATS)]) * 1e3
    engine.abort(stream.request_id)
    await beside
    after = engine.stats().cold_starts_total
    row["started"] = {way: count - before.get(way, 0) for way, count in after.items()}
    row["fastest"] = min(("pipelined", "cpu", "wait"), key=lambda way: row[f"{way}_ms"])
    return row


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    config = LlamaConfig(**(TINY_LLAMA if args.tiny else LLAMA2_7B))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    max_length = 128 if args.tiny else LENGTH_CAP  # the longest prompt
    lengths, source = prompt_lengths(args.trace, 4, max_length)
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "date": datetime.date.today().isoformat(), "lengths": lengths, "lengths_source": source,
                    "workers": args.workers, "cores_each": args.cores_each}
    progress(f"device: {report['device']}; torch {torch.__version__}; lengths {lengths}; "
             f"{args.workers} CPU LoRA workers x {args.cores_each} cores")
    tokenizer = bench_tokenizer(config.vocab_size)
    requests = Requests(tokenizer)
    model = random_llama(config, device=device, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    with tempfile.TemporaryDirectory(prefix="cpu-assist-store-") as tmp:
        store = AdapterStore(Path(tmp), config, BASE_MODEL, dtype, device)
        largest = AdapterShape(max(RANKS), ALL_SEVEN)
        blocker = store.new(largest)
        worker = WorkerConfig(
            device=str(device), base_model=BASE_MODEL, max_num_seqs=8, adapter_gpu_bytes=adapter_bytes(
                config, largest, itemsize), adapter_host_bytes=64 * adapter_bytes(config, largest, itemsize),
            max_lora_rank=max(RANKS), lora_targets=list(ALL_SEVEN), mode_policy="unmerged",
            max_batch_tokens=max(4096, 2 * max_length), kv_cache_tokens=4 * (HOLD_TOKENS + max_length),
            cpu_lora_workers=args.workers, cpu_lora_cores_each=args.cores_each, cpu_lora_shm_dir=args.shm_dir)
        parts = assemble_parts(model, worker, store.root)
        pool = parts.runner.cpu_lora
        report["rates_tokens_per_s_one_core"] = {
            rank: [int(pool.area.control[w, RATES + i]) for w in range(args.workers)]
            for i, rank in enumerate(RATE_RANKS)}
        progress(f"one-core LoRA rates (tokens/s) by rank: {report['rates_tokens_per_s_one_core']}")
        freeze_startup_heap()
        rows, hold_tokens = [], min(HOLD_TOKENS, config.max_position_embeddings - 32)
        with running_engine(parts, tokenizer, max(RANKS), async_scheduling_on(worker.async_scheduling, device)) \
                as engine:
            async def cells() -> None:
                policy = parts.scheduler.cold_start
                await cell(engine, policy, requests, blocker.ref, store.new(AdapterShape(8, QKV)).ref, lengths[0],
                           hold_tokens)  # warm-up
                for rank in RANKS:
                    for length in lengths:
                        row = await cell(engine, policy, requests, blocker.ref, store.new(AdapterShape(rank, QKV)).ref,
                                         length, hold_tokens)
                        rows.append(row)
                        progress(f"rank {rank} q,k,v, {length} tokens: " + ", ".join(
                            f"{way} {row[f'{way}_ms']:.1f}" for way in (*WAYS, "resident")) +
                            f" ms; fastest {row['fastest']}; started {row['started']}")
            asyncio.run(cells())
        report["rows"] = rows
        report["cpu_lora"] = dataclasses.asdict(engine.stats().cpu_lora)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = suite_parser(__doc__)
    add_tiny_run_options(parser)
    add_cpu_lora_options(parser)
    return parse_tiny_run_args(parser, argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = run(args)
    print("The fastest way from host memory, and each way's TTFT over resident, by rank (rows) and prompt length "
          "(columns):", flush=True)
    print("rank  " + "".join(f"{n:>28}" for n in report["lengths"]))
    for rank in RANKS:
        print(f"{rank:<6}" + "".join(
            f"{row['fastest']:>10} " + "/".join(f"{row[f'{way}_ms'] / row['resident_ms']:.2f}" for way in WAYS)
            for row in report["rows"] if row["rank"] == rank))
    print(f"(each cell: the fastest, then {' / '.join(WAYS)} over resident)")
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
