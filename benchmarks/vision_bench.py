"""Vision-language serving benchmark: a LLaVA-1.5-7B-shaped model (random bf16 weights) behind the engine.

The model: CLIP ViT-L/14-336 tower (576 image tokens per image), 2-layer GELU projector, Llama-2-7B
language model (vocab 32064), built on the device from configs alone, served by the real Engine
(its thread, continuous batching, paged KV, CUDA graphs, image-embedding cache, KV prefix cache)
with 8 random rank-64 q,k,v,o adapters; requests go round robin over them. Requests are chat
prompts with JPEG images, as the gRPC servicer hands them to Engine.submit, which decodes and
preprocesses the images (CLIP image processor) and tokenizes (a word-level tokenizer over the
model's vocabulary, without EOS: every request makes exactly max_tokens tokens).

Workloads, each at 1, 8 and 32 concurrent requests (bursts submitted together, repeated until a
level has at least 16 requests), after one unmeasured burst at every level (kernels compiled):
  vqa:    1 image (640x480) + 23 question words: 601 prompt tokens; 100 output tokens;
  video:  6 frames + 12 words: 3470 prompt tokens; 10 output tokens.
Each with the caches (defaults: image_cache_bytes 256 MiB, prefix caching on; each adapter's
requests ask new questions about its own image or video, seen in the warm-up, so every image is a
cache hit and the prompt up to the question comes from the KV prefix cache) and without them
(image_cache_bytes=0, enable_prefix_caching=False, a new image for every request).

Per request: TTFT (submit call -> first token on the caller's event loop), TPOT (mean time between
later tokens) and prep (time inside Engine.submit: image decoding and preprocessing, tokenization;
submits run one at a time, as on the servicer's event loop, but on a thread of their own so the loop
that timestamps tokens is never blocked); median and p90 over each level's requests.

    PYTHONPATH=.:protos python3 benchmarks/vision_bench.py [--json OUT.json]
    PYTHONPATH=.:protos python3 benchmarks/vision_bench.py --tiny   # a tiny LLaVA on CPU, in seconds
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import math
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import LlavaConfig, LlavaProcessor

from benchmarks.harness.cli import suite_parser
from benchmarks.harness.llava import (BASE_MODEL, SPECIAL_WORDS, llava_7b_config, llava_parts, tiny_llava_config,
                                      word_processor)
from benchmarks.harness.pictures import jpeg
from benchmarks.harness.report import Report, percentile, write_json
from benchmarks.harness.serving import running_engine
from benchmarks.harness.shapes import RANK, TARGETS
from gpu_worker.builder import async_scheduling_on
from gpu_worker.device_kind import device_name
from gpu_worker.delivery import RequestHandle
from gpu_worker.engine import Engine
from gpu_worker.intake import GenerationRequest
from gpu_worker.stats import EngineStats
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.prompts import ChatMessage, ImagePart
from gpu_worker.sequence import SamplingParams
from services.common.config import WorkerConfig


@dataclass(frozen=True)
class Workload:
    name: str
    images: int      # per request
    words: int       # question words after the images
    max_tokens: int  # every request makes exactly this many tokens


@dataclass(frozen=True)
class Setup:
    config: LlavaConfig
    device: str
    rank: int
    adapters: int
    concurrency: tuple[int, ...]
    min_requests: int             # per concurrency level, in whole bursts
    image_size: tuple[int, int]   # (width, height) of the JPEGs sent
    workloads: tuple[Workload, ...]


FULL = Setup(
    config=llava_7b_config(),
    device="cuda", rank=RANK, adapters=8, concurrency=(1, 8, 32), min_requests=16, image_size=(640, 480),
    workloads=(Workload("vqa", images=1, words=23, max_tokens=100),
               Workload("video", images=6, words=12, max_tokens=10)))
TINY = Setup(
    config=tiny_llava_config(),
    device="cpu", rank=8, adapters=4, concurrency=(1, 4), min_requests=4, image_size=(64, 48),
    workloads=(Workload("vqa", images=1, words=8, max_tokens=6), Workload("video", images=6, words=4, max_tokens=3)))


# --- requests ---------------------------------------------------------------------------------

@dataclass
class RequestMaker:
    """Each engine's requests: fresh question words every time; with `reuse`, each adapter's requests
    show the same images (its picture, its video) again, otherwise every request has new images."""
    setup: Setup
    reuse: bool
    seeds: Iterator[int] = field(default_factory=itertools.count)
    ids: Iterator[int] = field(default_factory=itertools.count)
    pools: dict[tuple[str, int], tuple[bytes, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(0)
        self.adapters = [AdapterRef(f"bench-{i}", BASE_MODEL, self.setup.rank, f"{i:064x}", "")
                         for i in range(self.setup.adapters)]

    def _images(self, workload: Workload, adapter: int) -> tuple[bytes, ...]:
        key = (workload.name, adapter)
        if not self.reuse or key not in self.pools:
            self.pools[key] = tuple(jpeg(next(self.seeds), self.setup.image_size) for _ in range(workload.images))
        return self.pools[key]

    def request(self, workload: Workload, adapter: int) -> GenerationRequest:
        first_word = len(SPECIAL_WORDS)
        words = self.rng.integers(first_word, self.setup.config.image_token_index, workload.words)
        content = (*map(ImagePart, self._images(workload, adapter)), " ".join(f"w{i}" for i in words))
        return GenerationRequest(f"{workload.name}-{next(self.ids)}", (ChatMessage("user", content),),
                                 SamplingParams(max_tokens=workload.max_tokens), self.adapters[adapter])

    def bursts(self, workload: Workload, concurrency: int, count: int) -> list[list[GenerationRequest]]:
        """`count` bursts of `concurrency` requests, request j of them on adapter j % adapters."""
        adapters = itertools.cycle(range(self.setup.adapters))
        return [[self.request(workload, next(adapters)) for _ in range(concurrency)] for _ in range(count)]


# --- measurement ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Timing:
    prep_s: float
    ttft_s: float
    tpot_s: float
    prompt_tokens: int
    output_tokens: int


async def _timed(engine: Engine, request: GenerationRequest, submitter: ThreadPoolExecutor) -> Timing:
    loop = asyncio.get_running_loop()

    def submit() -> tuple[RequestHandle, float]:
        started = time.perf_counter()
        return engine.submit(request, loop), time.perf_counter() - started

    started = time.perf_counter()
    handle, prep_s = await loop.run_in_executor(submitter, submit)
    arrivals, last = [], None
    async for output in handle:
        arrivals.extend([time.perf_counter()] * len(output.token_ids))
        last = output
    assert last.completion_tokens == request.params.max_tokens == len(arrivals), (last, request.params)
    tpot = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else 0.0
    return Timing(prep_s, arrivals[0] - started, tpot, last.prompt_tokens, last.completion_tokens)


def run_bursts(engine: Engine, bursts: list[list[GenerationRequest]]) -> list[Timing]:
    """Each burst's requests submitted together; the next burst once all of them finished."""
    async def main() -> list[Timing]:
        timings: list[Timing] = []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="submit") as submitter:
            for burst in bursts:
                timings += await asyncio.gather(*(_timed(engine, r, submitter) for r in burst))
        return timings
    return asyncio.run(main())


def _ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1e3


def measure_level(engine: Engine, maker: RequestMaker, workload: Workload, concurrency: int) -> dict:
    bursts = maker.bursts(workload, concurrency, math.ceil(maker.setup.min_requests / concurrency))
    before: EngineStats = engine.stats()
    started = time.perf_counter()
    timings = run_bursts(engine, bursts)
    wall = time.perf_counter() - started
    after = engine.stats()
    prompt_tokens = sum(t.prompt_tokens for t in timings)
    ttft, tpot, prep = ([getattr(t, f) for t in timings] for f in ("ttft_s", "tpot_s", "prep_s"))
    return dict(workload=workload.name, concurrency=concurrency, requests=len(timings),
                prompt_tokens=round(prompt_tokens / len(timings)), output_tokens=workload.max_tokens,
                ttft_p50_ms=_ms(ttft, 50), ttft_p90_ms=_ms(ttft, 90), tpot_p50_ms=_ms(tpot, 50),
                tpot_p90_ms=_ms(tpot, 90), prep_p50_ms=_ms(prep, 50), prep_p90_ms=_ms(prep, 90),
                image_hits=after.image_cache_hits_total - before.image_cache_hits_total,
                image_misses=after.image_cache_misses_total - before.image_cache_misses_total,
                prefix_hit_frac=(after.prefix_cache_hit_tokens_total - before.prefix_cache_hit_tokens_total)
                / prompt_tokens,
                preemptions=after.preemptions_total - before.preemptions_total, wall_s=wall,
                output_tok_per_s=len(timings) * workload.max_tokens / wall)


def bench_engine(report: Report, setup: Setup, caches: bool, processor: LlavaProcessor) -> None:
    defaults = WorkerConfig()
    worker = WorkerConfig(base_model=BASE_MODEL, device=setup.device, max_num_seqs=max(defaults.max_num_seqs,
                          *setup.concurrency), adapter_slots=setup.adapters, max_lora_rank=setup.rank,
                          lora_targets=TARGETS, enable_prefix_caching=caches,
                          image_cache_bytes=defaults.image_cache_bytes if caches else 0)
    started = time.perf_counter()
    parts = llava_parts(setup.config, worker)
    with running_engine(parts, processor.tokenizer, worker.max_lora_rank,
                        async_scheduling_on(worker.async_scheduling, torch.device(worker.device)), processor=processor,
                        base_model=worker.base_model) as engine:
        kv_tokens = engine.stats().free_kv_tokens
        print(f"caches {'on' if caches else 'off'}: engine ready in {time.perf_counter() - started:.1f} s, "
              f"KV cache {kv_tokens} tokens, max_batch_tokens {worker.max_batch_tokens}", flush=True)
        maker = RequestMaker(setup, reuse=caches)
        for workload in setup.workloads:
            print(f"{workload.name}: warming up", flush=True)
            # One burst at each level (and one on every adapter) compiles the kernels for these shapes
            # first; with caches on, it also puts every adapter's images into the image cache and its
            # prompts' K/V into the prefix cache.
            for concurrency in sorted({*setup.concurrency, setup.adapters}):
                run_bursts(engine, maker.bursts(workload, concurrency, 1))
            for concurrency in setup.concurrency:
                report.add(kind="serve", caches="on" if caches else "off", kv_cache_tokens=kv_tokens,
                           **measure_level(engine, maker, workload, concurrency))
    del engine, parts
    gc.collect()
    if setup.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the next engine sizes its KV cache from free memory
        print(f"engine stopped: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated", flush=True)


# --- report -----------------------------------------------------------------------------------

def versions() -> dict[str, str]:
    found = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        found["triton"] = metadata.version("triton")
    except metadata.PackageNotFoundError:
        found["triton"] = "none"
    if torch.cuda.is_available():
        try:
            found["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                             capture_output=True, text=True, timeout=10).stdout.split("\n")[0].strip()
        except (OSError, subprocess.SubprocessError):
            found["driver"] = "unknown"
    return found


def print_table(rows: list[dict]) -> None:
    print(f"{'caches':6} {'workload':8} {'conc':>4} {'reqs':>4} {'prompt':>6} {'out':>4} | "
          f"{'TTFT p50':>9} {'p90 ms':>8} | {'TPOT p50':>8} {'p90 ms':>7} | {'prep p50':>8} {'p90 ms':>7} | "
          f"{'img hit/miss':>12} {'prefix':>6} {'preempt':>7} {'tok/s':>7}")
    for r in rows:
        print(f"{r['caches']:6} {r['workload']:8} {r['concurrency']:4d} {r['requests']:4d} {r['prompt_tokens']:6d} "
              f"{r['output_tokens']:4d} | {r['ttft_p50_ms']:9.1f} {r['ttft_p90_ms']:8.1f} | {r['tpot_p50_ms']:8.2f} "
              f"{r['tpot_p90_ms']:7.2f} | {r['prep_p50_ms']:8.1f} {r['prep_p90_ms']:7.1f} | "
              f"{r['image_hits']:>5d}/{r['image_misses']:<6d} {r['prefix_hit_frac']:6.2f} {r['preemptions']:7d} "
              f"{r['output_tok_per_s']:7.0f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = suite_parser(__doc__)
    parser.add_argument("--tiny", action="store_true", help="a tiny LLaVA on CPU, few requests (a smoke run)")
    parser.add_argument("--concurrency", type=int, nargs="+", help="concurrency levels (default: 1 8 32)")
    parser.add_argument("--json", type=Path, help="write the header and every row here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    setup = TINY if args.tiny else FULL
    if args.concurrency:
        setup = replace(setup, concurrency=tuple(args.concurrency))
    assert setup.device == "cpu" or torch.cuda.is_available(), "this benchmark needs a CUDA device (or --tiny)"
    report = Report(device=device_name(torch.device(setup.device)))
    processor = word_processor(setup.config)
    header = {"device": report.device, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "versions": versions(), "model": "tiny LLaVA" if args.tiny else "LLaVA-1.5-7B shape, random weights",
              "adapters": setup.adapters, "rank": setup.rank, "targets": TARGETS, "image_size": setup.image_size,
              "image_processor": type(processor.image_processor).__name__,
              "workloads": [vars(w) for w in setup.workloads]}
    for key, value in header.items():
        print(f"{key}: {value}", flush=True)
    for caches in (True, False):
        bench_engine(report, setup, caches, processor)
    print(f"\n{header['device']}, {header['date']}, " + ", ".join(f"{k} {v}" for k, v in header["versions"].items()))
    print_table(report.rows)
    result = {**header, "rows": report.rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
