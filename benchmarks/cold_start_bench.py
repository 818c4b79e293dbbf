"""Cold-start benchmark of the worker's adapter tiers (GPU memory, host memory, disk) on a 7B-shaped
Llama (Llama-2-7B config, random bf16 weights), one GPU. Adapters are real PEFT files in an adapter
store (benchmarks/harness/adapter_files.py) that the worker's loader reads, verifies and parses. In one run:

  1. no stall: S streams (rank-64 q,k,v,o adapters, pinned) decode long outputs; over a window in
     which a request (a short prompt, one token) arrives every 100 ms, their TPOT (each stream's mean
     gap in the window; p50/p99 over streams) and their inter-token gaps (ITL p50/p99 over tokens),
     (a) on one of the streams' resident adapters, (b) on a new adapter from disk (ranks 8..128 in
     turn, q,k,v,o and all seven projections alternating), loads asynchronous, (c) the same new
     adapters with worker.adapter_synchronous_loads (every load stalls the engine: the baseline, on
     its own engine beside its own no-load window). (a) and (b) alternate for `stall_rounds` rounds
     (medians; one 3 s window's p99 is about the third-slowest of ~250 steps, and two no-load windows differ
     by up to 2x). Ratios (b)/(a) [target <= 1.05] and (c)/(a). The
     engine's steps launched in the window tell slow steps (decode-only, with prefills) from late tokens.
  2. cold TTFT: over prompt lengths from the shared conv trace (quantiles, capped at 2048), the TTFT
     of a lone request whose adapter is (a) resident, (b) in host memory only (evicted from the GPU
     by using the largest adapters; eviction lru), (c) on disk only. (b)/(a) [target <= 1.10], (c)/(a);
     (a) and (b) are medians of `repeats`, each with its wait from submit to its prefill's launch.
  3. capacity: the GPU bytes one adapter occupies (what the tiers' gpu_bytes grow by as it alone
     loads) against its true bytes (its A and B) [target <= 1.1], beside a max_lora_rank-padded slot
     of every served projection, for ranks 8..128 on q,k,v,o and on all seven.
  4. transfer: host -> GPU GB/s of an install (rank 128, all seven) against a page-locked copy of
     the same bytes; disk -> host GB/s of the loader (read, verify, parse, copy into page-locked
     memory) against a plain read of the same files, page cache warm and dropped (posix_fadvise;
     the store's filesystem is reported: on tmpfs nothing is dropped).
The GPU tier holds the streams' adapters and load_room more of the largest; the loads evict each
other, never the streams' (pinned). Adapters of one shape share their weights file (hard links), so
the weights of "new" adapters are in the page cache in 1 and 2 unless the machine is short of memory.

    PYTHONPATH=.:protos python3 -m benchmarks.cold_start_bench [--quick] [--json OUT.json] [--trace CSV]
        [--store-dir DIR (default: the system's temp)] [--adapter-gpu-bytes N]
    PYTHONPATH=.:protos python3 -m benchmarks.cold_start_bench --device cpu --tiny   # CPU smoke run, ~10 s
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import gc
import itertools
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, PreTrainedTokenizerFast

from benchmarks.harness.adapter_files import (AdapterShape, AdapterStore, StoredAdapter, adapter_bytes,
                                              drop_from_page_cache, filesystem_of)
from benchmarks.harness.cli import add_tiny_run_options, command_line, parse_tiny_run_args, suite_parser
from benchmarks.harness.load_stall import StepLog, decode_only_gaps, stall_window
from benchmarks.harness.prompts import Requests
from benchmarks.harness.reference_rates import copy_seconds, read_seconds, timed
from benchmarks.harness.report import percentile, progress, write_json
from benchmarks.harness.serving import BASE_MODEL, bench_tokenizer, first_token_s, running_engine
from benchmarks.harness.shapes import ALL_SEVEN, LLAMA2_7B, QKVO, TINY_LLAMA
from benchmarks.harness.traces import LENGTH_CAP, prompt_lengths
from gpu_worker.builder import EngineParts, assemble_parts, async_scheduling_on
from gpu_worker.engine import Engine, StepRecord
from gpu_worker.lora.adapter_stats import AdapterTierStats
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.models.random_weights import random_llama
from services.common.config import WorkerConfig
from services.common.runtime import freeze_startup_heap

RANKS = (8, 16, 32, 64, 128)
# Arrival k's adapter: RANKS cycle while the target sets alternate (5 and 2 are coprime: 10 shapes).
SHAPES = tuple(AdapterShape(RANKS[k % len(RANKS)], (QKVO, ALL_SEVEN)[k % 2]) for k in range(2 * len(RANKS)))
STREAM_SHAPE = AdapterShape(64, QKVO)


@dataclass(frozen=True)
class Plan:
    streams: int = 32
    stream_adapters: int = 4  # distinct adapters among the streams (several: merged mode stays out)
    load_room: int = 4        # GPU adapters beyond the streams', shared by the loads
    stream_prompt: int = 128
    stream_tokens: int = 2048  # the streams' max_tokens: more than any window needs
    warm_tokens: int = 16      # tokens every stream has before the window opens
    window_s: float = 8.0
    interval_s: float = 0.1
    stall_rounds: int = 3      # no-stall windows alternate (a), (b) this many times: medians, and (a)'s spread
    arrival_prompt: int = 32
    lengths: int = 16
    max_length: int = LENGTH_CAP  # the longest cold-TTFT prompt: lengths are scaled to it
    repeats: int = 3


PLANS = {"full": Plan(), "quick": Plan(window_s=3.0, lengths=8, repeats=2),
         "tiny": Plan(streams=4, stream_adapters=2, load_room=2, stream_prompt=16, stream_tokens=600, warm_tokens=4,
                      window_s=1.0, arrival_prompt=8, lengths=4, max_length=128, repeats=2)}


def worker_config(plan: Plan, device: torch.device, config: LlamaConfig, gpu_bytes: int | None,
                  synchronous: bool) -> WorkerConfig:
    """The streams' adapters plus plan.load_room of the largest on the GPU; host memory for four more."""
    itemsize = torch.empty((), dtype=torch.bfloat16 if device.type == "cuda" else torch.float32).element_size()
    largest = adapter_bytes(config, AdapterShape(max(RANKS), ALL_SEVEN), itemsize)
    slots = plan.stream_adapters + plan.load_room
    worker = WorkerConfig(
        device=str(device), base_model=BASE_MODEL, max_num_seqs=plan.streams + 8, adapter_slots=slots,
        adapter_host_bytes=(gpu_bytes or slots * largest) + 4 * largest, adapter_eviction="lru",
        adapter_synchronous_loads=synchronous, max_lora_rank=max(RANKS), lora_targets=list(ALL_SEVEN),
        mode_policy="unmerged", max_batch_tokens=max(4096, 2 * plan.max_length),
        kv_cache_tokens=plan.streams * (plan.stream_prompt + plan.stream_tokens) + 4 * plan.max_length)
    return dataclasses.replace(worker, adapter_gpu_bytes=gpu_bytes) if gpu_bytes is not None else worker


def load_clock_s(stats: AdapterTierStats, source: str) -> float:
    """Seconds the tiers' own clock has counted for loads from `source` ("disk" or "host")."""
    return next(t.sum_s for t in stats.loads if t.source == source)


def evict_from_gpu(name: str, fillers: list[StoredAdapter], touch: Callable[[AdapterRef], None],
                   stats: Callable[[], AdapterTierStats]) -> None:
    """Use `fillers` (the largest adapters) in turn until `name` has left the GPU: under lru it is the
    least recently used there. The host tier, larger, keeps it."""
    for filler in itertools.islice(itertools.cycle(fillers), 3 * len(fillers)):
        if name not in stats().gpu_adapters:
            break
        touch(filler.ref)
    tiers = stats()
    assert name not in tiers.gpu_adapters and name in tiers.host_adapters, (name, tiers)


# --- 3. capacity, 4. transfer: the manager driven directly (no engine thread yet) ------------------

def capacity(parts: EngineParts, store: AdapterStore, worker: WorkerConfig, config: LlamaConfig) -> list[dict]:
    manager = parts.adapters
    padded = adapter_bytes(config, AdapterShape(worker.max_lora_rank, tuple(worker.lora_targets)),
                           parts.model.lm_head.weight.element_size())
    rows, occupied = [], {}
    for shape in sorted(SHAPES, key=lambda s: (len(s.targets), s.rank)):
        adapter = store.new(shape)
        before = manager.stats()
        manager.load_now(adapter.ref)
        manager.depart(adapter.ref)
        after = manager.stats()
        # An adapter it evicted gave back what it occupied (measured when it loaded).
        gone = sum(occupied[name] for name in set(before.gpu_adapters) - set(after.gpu_adapters))
        occupied[adapter.ref.name] = after.gpu_bytes - before.gpu_bytes + gone
        rows.append(dict(adapter=shape.label, rank=shape.rank, true_bytes=adapter.true_bytes,
                         gpu_bytes=occupied[adapter.ref.name], padded_slot_bytes=padded,
                         gpu_over_true=occupied[adapter.ref.name] / adapter.true_bytes,
                         padded_over_true=padded / adapter.true_bytes))
        progress(f"capacity {shape.label}: true {adapter.true_bytes / 2**20:.4g} MiB, on the GPU "
                 f"{rows[-1]['gpu_bytes'] / 2**20:.4g} MiB ({rows[-1]['gpu_over_true']:.3f}x), padded slot "
                 f"{rows[-1]['padded_over_true']:.2f}x")
    return rows


def transfer(parts: EngineParts, store: AdapterStore, fillers: list[StoredAdapter], plan: Plan,
             device: torch.device) -> dict:
    manager = parts.adapters

    def touch(ref: AdapterRef) -> None:
        manager.load_now(ref)
        manager.depart(ref)

    rates: dict = {}
    for cache in ("warm", "dropped"):
        adapter = store.new(AdapterShape(max(RANKS), ALL_SEVEN))  # weights hard-linked: cached since written
        size = sum(path.stat().st_size for path in adapter.files)
        if cache == "dropped":
            drop_from_page_cache(adapter.files)
        before = load_clock_s(manager.stats(), "disk")
        touch(adapter.ref)
        loader_s = load_clock_s(manager.stats(), "disk") - before
        if cache == "dropped":
            drop_from_page_cache(adapter.files)
        read_s = read_seconds(adapter.files)
        rates[f"disk_to_host_{cache}"] = dict(bytes=size, loader_gb_s=size / loader_s / 1e9,
                                              plain_read_gb_s=size / read_s / 1e9, loader_over_read=read_s / loader_s)
        progress(f"disk -> host, page cache {cache}: loader {size / loader_s / 1e9:.2f} GB/s, plain read "
                 f"{size / read_s / 1e9:.2f} GB/s")
    installs = []
    for _ in range(plan.repeats):
        evict_from_gpu(adapter.ref.name, fillers, touch, manager.stats)
        installs.append(timed(lambda: touch(adapter.ref), device))
    install_s, copy_s = statistics.median(installs), copy_seconds(adapter.true_bytes, device, plan.repeats)
    rates["host_to_gpu"] = dict(bytes=adapter.true_bytes, install_gb_s=adapter.true_bytes / install_s / 1e9,
                                copy_gb_s=adapter.true_bytes / copy_s / 1e9, install_over_copy=copy_s / install_s)
    progress(f"host -> GPU ({adapter.shape.label}): install {rates['host_to_gpu']['install_gb_s']:.2f} GB/s, "
             f"{'pinned copy' if device.type == 'cuda' else 'memcpy'} {rates['host_to_gpu']['copy_gb_s']:.2f} GB/s")
    return rates


# --- 1. no stall, 2. cold TTFT: through a running engine ------------------------------------------

def step_ms(steps: list[StepRecord], q: float) -> float:
    return percentile([step.duration_s for step in steps], q) * 1e3 if steps else math.nan


def no_stall(engine: Engine, steps: StepLog, requests: Requests, plan: Plan, case: str,
             stream_refs: list[AdapterRef], arrival_refs: list[AdapterRef] | None) -> dict:
    """A window of arrivals on `arrival_refs` (None: on the streams' resident adapters)."""
    count = round(plan.window_s / plan.interval_s)
    refs = arrival_refs or [stream_refs[k % len(stream_refs)] for k in range(count)]
    streams = [requests.make(stream_refs[i % len(stream_refs)], plan.stream_prompt, plan.stream_tokens)
               for i in range(plan.streams)]
    arrivals = [requests.make(ref, plan.arrival_prompt, 1) for ref in refs[:count]]
    result = asyncio.run(stall_window(engine, streams, arrivals, plan.interval_s, plan.warm_tokens))
    launched = steps.launched_between(result.started_at, result.ended_at)
    decodes = [step for step in launched if not step.num_prefills]
    prefills = [step for step in launched if step.num_prefills]
    decode_gaps = decode_only_gaps(result.spans, steps.prefill_launches())
    row = dict(itl_p50_ms=percentile(result.gaps_s, 50) * 1e3, itl_p99_ms=percentile(result.gaps_s, 99) * 1e3,
               tpot_p50_ms=percentile(result.stream_tpot_s, 50) * 1e3,
               tpot_p99_ms=percentile(result.stream_tpot_s, 99) * 1e3,
               decode_itl_p50_ms=percentile(decode_gaps, 50) * 1e3, decode_itl_p99_ms=percentile(decode_gaps, 99) * 1e3,
               decode_gaps=len(decode_gaps),
               decode_steps=len(decodes), decode_step_p50_ms=step_ms(decodes, 50), decode_step_p99_ms=step_ms(decodes, 99),
               prefill_steps=len(prefills), prefill_step_p50_ms=step_ms(prefills, 50),
               prefill_step_p99_ms=step_ms(prefills, 99),
               stream_tokens=len(result.gaps_s), window_s=result.window_s, arrivals=len(arrivals),
               arrival_ttft_p50_ms=percentile(result.arrival_ttft_s, 50) * 1e3,
               arrival_ttft_p99_ms=percentile(result.arrival_ttft_s, 99) * 1e3,
               counts=dict(disk_loads=result.disk_loads, gpu_evictions=result.gpu_evictions))
    progress(f"no stall ({case}): streams' TPOT p50 {row['tpot_p50_ms']:.2f} ms, p99 {row['tpot_p99_ms']:.2f} ms; "
             f"inter-token gaps p50 {row['itl_p50_ms']:.2f} ms, p99 {row['itl_p99_ms']:.2f} ms over "
             f"{row['stream_tokens']} tokens, without a prefill launched in the gap p50 {row['decode_itl_p50_ms']:.2f} "
             f"ms, p99 {row['decode_itl_p99_ms']:.2f} ms over {len(decode_gaps)}; steps launched: {len(decodes)} decode-only p50 "
             f"{row['decode_step_p50_ms']:.2f} / p99 {row['decode_step_p99_ms']:.2f} ms, {len(prefills)} with "
             f"prefills p50 {row['prefill_step_p50_ms']:.2f} / p99 {row['prefill_step_p99_ms']:.2f} ms; arrivals' "
             f"TTFT p50 {row['arrival_ttft_p50_ms']:.1f} ms, p99 {row['arrival_ttft_p99_ms']:.1f} ms; {row['counts']}")
    return row


def cold_ttft(engine: Engine, steps: StepLog, requests: Requests, store: AdapterStore, fillers: list[StoredAdapter],
              lengths: list[int], repeats: int) -> list[dict]:
    """Per length: TTFT from disk once, then from host and resident `repeats` times each (medians), and
    how long each waited before its prefill was launched (the load's share of its TTFT)."""
    def ttft(ref: AdapterRef, length: int) -> float:
        return timed_ttft(ref, length)[0]

    def timed_ttft(ref: AdapterRef, length: int) -> tuple[float, float]:
        """(TTFT, submit to its prefill's launch)."""
        request = requests.make(ref, length, 1)
        submitted = time.perf_counter()
        first = asyncio.run(first_token_s(engine, request))
        return first, steps.first_launch(request.request_id) - submitted

    def settled() -> AdapterTierStats:
        """The tiers once the engine has published its last request's end (its stats follow the outputs)."""
        deadline = time.monotonic() + 10.0
        while (tiers := engine.stats().adapters).pinned and time.monotonic() < deadline:
            time.sleep(0.001)
        return tiers

    rows = []
    for i, length in enumerate([lengths[-1]] + lengths):  # the first round warms up
        adapter = store.new(SHAPES[i % len(SHAPES)])
        disk, disk_admit = timed_ttft(adapter.ref, length)
        hosts, residents, compactions = [], [], 0
        for _ in range(repeats):
            evict_from_gpu(adapter.ref.name, fillers, lambda ref: ttft(ref, 2), settled)
            before = settled()
            hosts.append(timed_ttft(adapter.ref, length))
            after = settled()
            compactions += after.gpu_compactions - before.gpu_compactions
            residents.append(timed_ttft(adapter.ref, length))
        (host, host_admit), (resident, resident_admit) = (
            tuple(statistics.median(column) for column in zip(*pairs)) for pairs in (hosts, residents))
        if i:
            rows.append(dict(length=length, adapter=adapter.shape.label, resident_ms=resident * 1e3,
                             host_ms=host * 1e3, disk_ms=disk * 1e3, resident_admit_ms=resident_admit * 1e3,
                             host_admit_ms=host_admit * 1e3, disk_admit_ms=disk_admit * 1e3,
                             host_compactions=compactions))
            progress(f"cold TTFT, {length} tokens, {adapter.shape.label}: resident {resident * 1e3:.1f} ms, "
                     f"host {host * 1e3:.1f} ms, disk {disk * 1e3:.1f} ms (submit to prefill launch "
                     f"{resident_admit * 1e3:.1f} / {host_admit * 1e3:.1f} / {disk_admit * 1e3:.1f} ms; "
                     f"{compactions} compactions; medians of {repeats})")
    return rows


# --- the run ----------------------------------------------------------------------------------

def median_window(rows: list[dict]) -> dict:
    """Windows of one case over rounds: each figure's median, the loads summed, and each round's p99s."""
    merged = {key: statistics.median(row[key] for row in rows) for key, value in rows[0].items()
              if isinstance(value, (int, float))}
    merged["counts"] = {key: sum(row["counts"][key] for row in rows) for key in rows[0]["counts"]}
    merged["rounds_tpot_p99_ms"] = [row["tpot_p99_ms"] for row in rows]
    merged["rounds_itl_p99_ms"] = [row["itl_p99_ms"] for row in rows]
    return merged


def serve_phases(parts: EngineParts, tokenizer: PreTrainedTokenizerFast, requests: Requests, plan: Plan,
                 device: torch.device, cases: list[tuple[str, Callable[[], list[AdapterRef] | None]]],
                 stream_refs: list[AdapterRef], rounds: int,
                 cold: Callable[[Engine, StepLog], list[dict]] | None = None) -> tuple[dict, list[dict]]:
    """The no-stall windows `cases` (name, a maker of each round's arrival adapters) alternated for
    `rounds` rounds (one window of a case alone says little: see the spread of (a)), then `cold`, on
    one running engine."""
    steps = StepLog()
    freeze_startup_heap()  # as the worker's server does once its engine is built
    with running_engine(parts, tokenizer, max(RANKS), async_scheduling_on(WorkerConfig().async_scheduling, device),
                        on_step=steps) as engine:
        # Untimed first: a fresh engine's first window pays for graph captures and kernel variants.
        no_stall(engine, steps, requests, plan, "warm-up", stream_refs, None)
        windows: dict[str, list[dict]] = {case: [] for case, _ in cases}
        for _ in range(rounds):
            for case, arrivals in cases:
                windows[case].append(no_stall(engine, steps, requests, plan, case, stream_refs, arrivals()))
        return {case: median_window(rows) for case, rows in windows.items()}, cold(engine, steps) if cold else []


def run(args: argparse.Namespace) -> dict:
    device, plan = torch.device(args.device), PLANS["tiny" if args.tiny else "quick" if args.quick else "full"]
    config = LlamaConfig(**(TINY_LLAMA if args.tiny else LLAMA2_7B))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lengths, source = prompt_lengths(args.trace, plan.lengths, plan.max_length)
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "date": datetime.date.today().isoformat(), "plan": dataclasses.asdict(plan),
                    "lengths_source": source}
    progress(f"device: {report['device']}; torch {torch.__version__}; {plan}")
    progress(f"cold-TTFT prompt lengths {lengths} from {source}")
    tokenizer = bench_tokenizer(config.vocab_size)
    requests = Requests(tokenizer)
    model = random_llama(config, device=device, dtype=dtype)
    with tempfile.TemporaryDirectory(prefix="cold-start-store-", dir=args.store_dir) as tmp:
        report["store_filesystem"] = filesystem_of(Path(tmp))
        progress(f"adapter store {tmp} ({report['store_filesystem']}): writing adapters")
        store = AdapterStore(Path(tmp), config, BASE_MODEL, dtype, device)
        stream_refs = [store.new(STREAM_SHAPE).ref for _ in range(plan.stream_adapters)]

        def new_arrivals() -> list[AdapterRef]:
            """Adapters no engine has seen, one per arrival of a window."""
            return [store.new(SHAPES[k % len(SHAPES)]).ref for k in range(round(plan.window_s / plan.interval_s))]
        worker = worker_config(plan, device, config, args.adapter_gpu_bytes, synchronous=False)
        parts = assemble_parts(model, worker, store.root)
        tiers = parts.adapters.stats()
        report["tiers"] = {"gpu_capacity_bytes": tiers.gpu_capacity_bytes, "adapter_slots": worker.adapter_slots,
                           "host_capacity_bytes": tiers.host_capacity_bytes}
        progress(f"engine ready: GPU tier {tiers.gpu_capacity_bytes / 2**30:.2f} GiB, host tier "
                 f"{tiers.host_capacity_bytes / 2**30:.2f} GiB (adapter_slots {worker.adapter_slots})")
        # Enough of the largest adapters to fill the GPU tier: using them evicts any other adapter there.
        largest = AdapterShape(max(RANKS), ALL_SEVEN)
        fillers = [store.new(largest) for _ in range(math.ceil(
            tiers.gpu_capacity_bytes / adapter_bytes(config, largest, parts.model.lm_head.weight.element_size())) + 1)]
        report["capacity"] = capacity(parts, store, worker, config)
        report["transfer"] = transfer(parts, store, fillers, plan, device)
        windows, report["cold_ttft"] = serve_phases(
            parts, tokenizer, requests, plan, device, [("a_no_loads", lambda: None), ("b_async_loads", new_arrivals)],
            stream_refs, plan.stall_rounds, lambda engine, steps: cold_ttft(engine, steps, requests, store, fillers, lengths, plan.repeats))
        del parts  # its KV cache and adapter memory, before the baseline's engine takes its own
        gc.unfreeze()  # a frozen cycle is never collected
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            progress(f"{torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated between the engines")
        progress("the baseline: an engine with synchronous adapter loads")
        parts = assemble_parts(model, worker_config(plan, device, config, args.adapter_gpu_bytes, True), store.root)
        sync_windows, _ = serve_phases(parts, tokenizer, requests, plan, device,
                                       [("a_sync_no_loads", lambda: None), ("c_sync_loads", new_arrivals)], stream_refs,
                                       rounds=1)  # every load stops every stream: once says enough
    report["no_stall"] = windows | sync_windows
    report["ratios"] = ratios(report)
    return report


def ratios(report: dict) -> dict:
    rows, transfer_rates = report["cold_ttft"], report["transfer"]

    def p99(case: str, measure: str = "tpot") -> float:
        return report["no_stall"][case][f"{measure}_p99_ms"]

    def mean(key: str) -> float:
        return statistics.fmean(row[key] for row in rows)

    return {
        "no_stall_tpot_p99_b_over_a": p99("b_async_loads") / p99("a_no_loads"),
        "no_stall_tpot_p99_c_over_a": p99("c_sync_loads") / p99("a_sync_no_loads"),
        "no_stall_tpot_p99_a_sync_over_a": p99("a_sync_no_loads") / p99("a_no_loads"),  # run-to-run noise
        "no_stall_itl_p99_b_over_a": p99("b_async_loads", "itl") / p99("a_no_loads", "itl"),
        "no_stall_itl_p99_c_over_a": p99("c_sync_loads", "itl") / p99("a_sync_no_loads", "itl"),
        "no_stall_decode_itl_p99_b_over_a": p99("b_async_loads", "decode_itl") / p99("a_no_loads", "decode_itl"),
        "no_stall_decode_itl_p50_b_over_a": (report["no_stall"]["b_async_loads"]["decode_itl_p50_ms"]
                                             / report["no_stall"]["a_no_loads"]["decode_itl_p50_ms"]),
        "cold_ttft_host_over_resident": mean("host_ms") / mean("resident_ms"),
        "cold_ttft_host_over_resident_worst": max(row["host_ms"] / row["resident_ms"] for row in rows),
        "cold_ttft_disk_over_resident": mean("disk_ms") / mean("resident_ms"),
        "capacity_gpu_over_true_worst": max(row["gpu_over_true"] for row in report["capacity"]),
        "host_to_gpu_install_over_copy": transfer_rates["host_to_gpu"]["install_over_copy"],
        "disk_to_host_warm_loader_over_read": transfer_rates["disk_to_host_warm"]["loader_over_read"],
        "disk_to_host_dropped_loader_over_read": transfer_rates["disk_to_host_dropped"]["loader_over_read"]}


TARGETS = {"no_stall_tpot_p99_b_over_a": 1.05, "no_stall_itl_p99_b_over_a": 1.05, "cold_ttft_host_over_resident": 1.10,
           "capacity_gpu_over_true_worst": 1.1}  # issue 39


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = suite_parser(__doc__)
    add_tiny_run_options(parser)
    parser.add_argument("--quick", action="store_true", help="shorter windows, 8 prompt lengths")
    parser.add_argument("--store-dir", type=Path, help="where the adapter store is made (default: the system's temp)")
    parser.add_argument("--adapter-gpu-bytes", type=int,
                        help="worker.adapter_gpu_bytes, where the worker has it (default: not set)")
    args = parse_tiny_run_args(parser, argv)
    if args.adapter_gpu_bytes is not None and "adapter_gpu_bytes" not in WorkerConfig.__dataclass_fields__:
        parser.error("--adapter-gpu-bytes: this worker's config has no adapter_gpu_bytes")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = run(args)
    report["command"] = command_line("benchmarks.cold_start_bench", argv)
    for key, value in report["ratios"].items():
        target = f"  (target <= {TARGETS[key]})" if key in TARGETS else ""
        print(f"{key}: {value:.3f}{target}", flush=True)
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
