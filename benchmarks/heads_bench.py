"""Task heads against generation on a LLaVA-1.5-7B-shaped model (random bf16 weights) behind the engine.
VaLoRA's claim: a head answers in one pass what the LM head answers in several decode rounds.

Adapters (rank 64 on q, k, v, o, random): 8 that generate, and two with task heads (docs/task-heads.md):
VaLoRA's action-recognition head (the last token -> Linear(4096, 2048) -> Linear(2048, 8 labels)) and a
DETR-style detection head (the last 8 positions, 20 labels, box MLP 4096 -> 2048 -> 2048 -> 4). Requests
carry one 640x480 JPEG (576 image tokens) and 23 question words: 601 prompt tokens, a new image each.

1. latency: a head request (submit -> answer) against a generating request making the answer as text:
   an action label is LABEL_TOKENS tokens; a detection BOXES boxes of BOX_TOKENS tokens each ("cat 0.12
   0.34 0.56 0.78;" in a Llama tokenizer: every digit a token). Alone, then 8 at once; medians, and the
   ratio head / generation.
2. interference: STREAMS generating streams (vqa prompts) decoding; their TPOT p50 over the window from
   their last first token to their first finish, alone, and beside classify requests arriving every
   1 / rate s on the action head: text prompts of 32 words, then image prompts; and, as the baseline any
   prefill sets, the text prompts as 1-token generations on a generating adapter. The ratio beside / alone,
   and the latency p50 and p99 of the requests beside.
Every row also says what the engine's steps did meanwhile: how many, their mean and p90 duration (launch to
tokens on the host), how many ran a prefill, and how many ran merged or mixture (the mode policy's choice).

    PYTHONPATH=.:protos python3 benchmarks/heads_bench.py [--json OUT.json] [--parts interference]
    PYTHONPATH=.:protos python3 benchmarks/heads_bench.py --tiny   # a tiny LLaVA on CPU, in seconds
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import torch
from transformers import LlavaConfig, LlavaProcessor

from benchmarks.harness.cli import parse_gpu_or_tiny_args
from benchmarks.harness.head_adapters import adapters_with_heads, head_adapters
from benchmarks.harness.llava import (BASE_MODEL, SPECIAL_WORDS, llava_7b_config, llava_parts, tiny_llava_config,
                                      word_processor)
from benchmarks.harness.pictures import jpeg
from benchmarks.harness.report import Report, percentile, write_json
from benchmarks.harness.serving import running_engine
from benchmarks.harness.shapes import RANK, TARGETS
from gpu_worker.builder import async_scheduling_on
from gpu_worker.device_kind import device_name
from gpu_worker.engine import Engine, StepRecord
from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.prompts import ChatMessage, ImagePart
from gpu_worker.sequence import SamplingParams
from services.common.config import WorkerConfig
from services.demo_heads import DemoHead

LABEL_TOKENS = 4
BOXES, BOX_TOKENS = 4, 18
STREAM_WORDS, TEXT_CLASSIFY_WORDS = 23, 32


@dataclass(frozen=True)
class Setup:
    config: LlavaConfig
    device: str
    rank: int
    adapters: int                # generating ones
    heads: tuple[DemoHead, ...]  # the action and the detection head
    image_size: tuple[int, int]
    repeats: int                 # bursts per latency case
    streams: int
    stream_tokens: int
    classify_rate: float         # classify requests per second beside the streams


FULL = Setup(llava_7b_config(), "cuda", RANK, 8,
             (DemoHead("mlp", tuple(f"action{i}" for i in range(8)), inner=2048),
              DemoHead("detection", tuple(f"object{i}" for i in range(20)), num_queries=8, inner=2048)),
             (640, 480), repeats=6, streams=32, stream_tokens=384, classify_rate=64.0)
TINY = Setup(tiny_llava_config(), "cpu", 8, 2,
             (DemoHead("mlp", ("a", "b", "c"), inner=16), DemoHead("detection", ("x", "y"), num_queries=3, inner=16)),
             (64, 48), repeats=2, streams=3, stream_tokens=16, classify_rate=20.0)


@dataclass
class Requests:
    setup: Setup
    heads: list[AdapterRef]
    ids: itertools.count = dataclasses.field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(0)
        self.adapters = [AdapterRef(f"bench-{i}", BASE_MODEL, self.setup.rank, f"{i:064x}", "")
                         for i in range(self.setup.adapters)]

    def _words(self, count: int) -> str:
        words = self.rng.integers(len(SPECIAL_WORDS), self.setup.config.image_token_index, count)
        return " ".join(f"w{i}" for i in words)

    def _content(self, image: bool, words: int) -> tuple:
        picture = (ImagePart(jpeg(next(self.ids), self.setup.image_size)),) if image else ()
        return (ChatMessage("user", (*picture, self._words(words))),)

    def generate(self, adapter: int, max_tokens: int, image: bool = True, words: int = STREAM_WORDS) -> GenerationRequest:
        return GenerationRequest(f"g{next(self.ids)}", self._content(image, words),
                                 SamplingParams(max_tokens=max_tokens), self.adapters[adapter % len(self.adapters)])

    def classify(self, head: int, image: bool = True, words: int = STREAM_WORDS) -> GenerationRequest:
        return GenerationRequest(f"c{next(self.ids)}", self._content(image, words), SamplingParams(), self.heads[head],
                                 task_head=True)


async def _timed(engine: Engine, request: GenerationRequest) -> list[float]:
    """Submitted (through the intake threads, as the servicer does), then each output's arrival: perf_counter
    times, the submit's first."""
    started = time.perf_counter()
    handle = await engine.submit_async(request)
    return [started] + [time.perf_counter() async for _ in handle]


def _latency(times: list[float]) -> float:
    return times[-1] - times[0]


def _burst(engine: Engine, requests: list[GenerationRequest]) -> list[float]:
    """Each request's time to its last output, all submitted at once."""
    async def main() -> list[list[float]]:
        return await asyncio.gather(*(_timed(engine, r) for r in requests))
    return [_latency(times) for times in asyncio.run(main())]


@dataclass
class StepLog:
    """The engine's steps (its on_step callback, on the engine thread) since the last `take`."""
    steps: list[StepRecord] = dataclasses.field(default_factory=list)

    def take(self) -> dict:
        steps = self.steps[:]
        del self.steps[:len(steps)]  # in place: the engine appends to this list
        durations = [s.duration_s * 1e3 for s in steps] or [0.0]
        return dict(steps=len(steps), step_mean_ms=statistics.fmean(durations), step_p90_ms=percentile(durations, 90),
                    prefill_steps=sum(1 for s in steps if s.num_prefills),
                    merged_steps=sum(1 for s in steps if s.mode != "unmerged"))


def measure_latency(engine: Engine, requests: Requests, report: Report, log: StepLog) -> None:
    for head, text_tokens in ((0, LABEL_TOKENS), (1, BOXES * BOX_TOKENS)):
        kind = requests.heads[head].head.kind
        for concurrency in (1, 8):
            _burst(engine, [requests.classify(head) for _ in range(concurrency)])  # warm-up: these shapes
            _burst(engine, [requests.generate(i, text_tokens) for i in range(concurrency)])
            heads, texts = [], []
            log.take()
            for _ in range(requests.setup.repeats):
                heads += _burst(engine, [requests.classify(head) for _ in range(concurrency)])
                texts += _burst(engine, [requests.generate(i, text_tokens) for i in range(concurrency)])
            head_ms, text_ms = statistics.median(heads) * 1e3, statistics.median(texts) * 1e3
            report.add(kind="latency", head=kind, concurrency=concurrency, text_tokens=text_tokens,
                       head_p50_ms=head_ms, generate_p50_ms=text_ms, ratio=head_ms / text_ms, **log.take())


# The requests sent beside the streams: what each makes.
BESIDE: dict[str, Callable[[Requests], GenerationRequest]] = {
    "text": lambda requests: requests.classify(0, False, TEXT_CLASSIFY_WORDS),
    "image": lambda requests: requests.classify(0, True, STREAM_WORDS),
    "text-generate-1": lambda requests: requests.generate(0, 1, image=False, words=TEXT_CLASSIFY_WORDS),
}


async def _streams(engine: Engine, requests: Requests, beside: str | None) -> tuple[list[float], list[float]]:
    """The streams' TPOTs over the shared window, and the latencies of the requests sent beside them."""
    setup = requests.setup
    streams = [asyncio.ensure_future(_timed(engine, requests.generate(i, setup.stream_tokens)))
               for i in range(setup.streams)]
    classified: list[asyncio.Future[list[float]]] = []
    if beside is not None:
        while not any(s.done() for s in streams):
            classified.append(asyncio.ensure_future(_timed(engine, BESIDE[beside](requests))))
            await asyncio.sleep(1 / setup.classify_rate)
    arrivals = [times[1:] for times in await asyncio.gather(*streams)]
    latencies = [_latency(times) for times in await asyncio.gather(*classified)]
    # The window: every stream has its first token, none has finished.
    first, last = max(a[0] for a in arrivals), min(a[-1] for a in arrivals)
    tpots = []
    for a in arrivals:
        inside = [t for t in a if first <= t <= last]
        if len(inside) > 1:
            tpots.append((inside[-1] - inside[0]) / (len(inside) - 1))
    return tpots, latencies


def measure_interference(engine: Engine, requests: Requests, report: Report, log: StepLog) -> None:
    asyncio.run(_streams(engine, requests, None))  # warm-up: the streams' shapes
    log.take()
    alone, _ = asyncio.run(_streams(engine, requests, None))
    alone_ms = statistics.median(alone) * 1e3
    report.add(kind="interference", classify="none", rate=0.0, tpot_p50_ms=alone_ms, tpot_ratio=1.0,
               classify_requests=0, classify_p50_ms=0.0, classify_p99_ms=0.0, **log.take())
    for beside in BESIDE:
        tpots, latencies = asyncio.run(_streams(engine, requests, beside))
        tpot_ms = statistics.median(tpots) * 1e3
        report.add(kind="interference", classify=beside, rate=requests.setup.classify_rate,
                   tpot_p50_ms=tpot_ms, tpot_ratio=tpot_ms / alone_ms, classify_requests=len(latencies),
                   classify_p50_ms=percentile(latencies, 50) * 1e3, classify_p99_ms=percentile(latencies, 99) * 1e3,
                   **log.take())


PARTS = ("latency", "interference")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_gpu_or_tiny_args(__doc__, argv, "a tiny LLaVA", lambda parser: parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure (default: both)"))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    setup = TINY if args.tiny else FULL
    report = Report(device=device_name(torch.device(setup.device)))
    header = {"device": report.device, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "model": "tiny LLaVA" if args.tiny else "LLaVA-1.5-7B shape, random weights", "rank": setup.rank,
              "heads": [dataclasses.asdict(h) for h in setup.heads], "image_size": setup.image_size}
    print(header, flush=True)
    heads, head_weights = head_adapters(setup.heads, setup.config.text_config.hidden_size, setup.rank, BASE_MODEL)
    worker = WorkerConfig(base_model=BASE_MODEL, device=setup.device, max_num_seqs=max(64, 2 * setup.streams),
                          adapter_slots=setup.adapters + len(heads), max_lora_rank=setup.rank, lora_targets=TARGETS)
    processor: LlavaProcessor = word_processor(setup.config)
    parts = llava_parts(setup.config, worker, adapters_with_heads(setup.config.text_config, head_weights, worker))
    log = StepLog()
    with running_engine(parts, processor.tokenizer, worker.max_lora_rank,
                        async_scheduling_on(worker.async_scheduling, torch.device(worker.device)),
                        on_step=log.steps.append, processor=processor, base_model=BASE_MODEL) as engine:
        requests = Requests(setup, heads)
        if "latency" in args.parts:
            measure_latency(engine, requests, report, log)
        if "interference" in args.parts:
            measure_interference(engine, requests, report, log)
    result = {**header, "rows": report.rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
