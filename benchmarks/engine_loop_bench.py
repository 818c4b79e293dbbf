"""What the engine's own loop adds to a decode step: scheduling, incremental detokenization, streaming
each token to the caller's asyncio loop, stats. One device, one run.

For each batch size and adapter case it measures, on one model:
  - bare step: `run_step` (benchmarks/harness/bare_steps.py, as engine_bench runs it: grow blocks,
    forward, sample, append the token ids), the median wall clock of a decode step: the device's work
    and the least host work a step needs;
  - engine loop: the same batch submitted as requests to a running Engine (its thread; outputs drained
    by an asyncio loop in this thread, as the gRPC servicer does), the median time between the ends of
    two consecutive decode steps that ran the whole batch (StepRecord), once with async scheduling
    (the default: the next decode step is launched before this one's tokens reach the host) and once
    without (one step at a time, the baseline);
and prints loop / bare for both, and the host time each loop adds a step and a sequence.

Then, with churn: 4x the largest batch of requests submitted at once, of random lengths (a third to
five thirds of --new-tokens), at most the largest batch running: requests finish and others are
admitted (their prefills joining the decodes) in most steps. It prints generated tokens per second
through each engine, async and one step at a time.

On CUDA the model is 7B-shaped (the Llama-2-7B config, random bf16 weights, CUDA graphs on),
with the locally trained demo tokenizer (its vocabulary replaces Llama-2's 32000, so that every sampled
id decodes). On CPU it is a tiny Llama of the same tokenizer (float32): there the step is host work too.

    PYTHONPATH=.:protos python3 -m benchmarks.engine_loop_bench [--batches 1 8 32] [--new-tokens 48] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from transformers import LlamaConfig, PreTrainedTokenizerBase

from benchmarks.harness.bare_steps import decode_step_seconds, new_sequences, prefill, release
from benchmarks.harness.cli import suite_parser
from benchmarks.harness.prompts import word_prompt
from benchmarks.harness.report import write_json
from benchmarks.harness.serving import BASE_MODEL, bench_request, bench_tokenizer, running_engine, serve
from benchmarks.harness.shapes import LLAMA2_7B, RANK, TARGETS, TINY_LLAMA
from gpu_worker.builder import EngineParts, assemble_parts
from gpu_worker.engine import Engine, StepRecord
from gpu_worker.models.random_weights import random_llama
from gpu_worker.profile import random_adapters
from services.common.config import WorkerConfig

PROMPT_TOKENS = 128
CASES = ("a_base", "c_own_adapters")  # engine_bench's names: no adapter; each request its own rank-64 adapter
T = TypeVar("T")


@dataclass(frozen=True)
class ChurnRow:
    case: str
    requests: int
    running: int           # at most this many at once
    tokens: int            # generated in all
    async_tokens_per_s: float
    sync_tokens_per_s: float

    def line(self) -> str:
        return (f"churn {self.case:15s} {self.requests} requests, {self.tokens} tokens, <= {self.running} running: "
                f"async {self.async_tokens_per_s:8.1f} tok/s  sync {self.sync_tokens_per_s:8.1f} tok/s  "
                f"async/sync {self.async_tokens_per_s / self.sync_tokens_per_s:5.3f}")


@dataclass(frozen=True)
class LoopRow:
    batch: int
    case: str
    bare_ms: float         # run_step's median decode step
    loop_ms: float         # median time between consecutive full-batch decode steps of the running engine
    loop_steps: int        # how many such step pairs were timed
    sync_ms: float         # the same without async scheduling
    sync_steps: int

    @property
    def host_ms(self) -> float:
        """What the loop adds to a step."""
        return self.loop_ms - self.bare_ms

    def line(self) -> str:
        sync_host_ms = self.sync_ms - self.bare_ms
        return (f"batch {self.batch:3d} {self.case:15s} bare {self.bare_ms:7.3f} ms  "
                f"loop {self.loop_ms:7.3f} ms ({self.loop_ms / self.bare_ms:5.3f}x bare, host {self.host_ms:+6.3f} ms, "
                f"{self.host_ms / self.batch * 1e3:6.1f} us a sequence; {self.loop_steps} steps)  "
                f"sync loop {self.sync_ms:7.3f} ms ({self.sync_ms / self.bare_ms:5.3f}x bare, "
                f"host {sync_host_ms:+6.3f} ms; {self.sync_steps} steps)  "
                f"sync/async {self.sync_ms / self.loop_ms:5.3f}")


def adapter_names(case: str, batch: int) -> list[str | None]:
    return [None] if case == "a_base" else [f"own-{i}" for i in range(batch)]


def build(device: torch.device, max_batch: int, tokenizer: PreTrainedTokenizerBase) -> EngineParts:
    shape = LLAMA2_7B if device.type == "cuda" else {**TINY_LLAMA, "max_position_embeddings": 4096}
    config = LlamaConfig(**{**shape, "vocab_size": len(tokenizer)})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_llama(config, device=device, dtype=dtype)
    worker = WorkerConfig(device=str(device), dtype=str(dtype).removeprefix("torch."), base_model=BASE_MODEL,
                          max_num_seqs=max_batch, max_batch_tokens=max(2048, max_batch * PROMPT_TOKENS),
                          adapter_slots=max_batch, max_lora_rank=RANK, lora_targets=TARGETS,
                          kv_cache_tokens=max_batch * 512 + 64, enable_prefix_caching=False)
    return assemble_parts(model, worker, Path("/nonexistent"), load=random_adapters(config, TARGETS, device, dtype))


def bare_step_ms(parts: EngineParts, batch: int, case: str, steps: int) -> float:
    gen = torch.Generator().manual_seed(batch)
    seqs = new_sequences(parts, batch, PROMPT_TOKENS, adapter_names(case, batch), gen)
    prefill(parts, seqs, parts.scheduler.limits.max_batch_tokens)
    seconds = decode_step_seconds(parts, seqs, steps)
    release(parts, seqs)
    return seconds * 1e3


def loop_step_ms(engine: Engine, records: list[tuple[float, StepRecord]], batch: int, case: str,
                 new_tokens: int) -> tuple[float, int]:
    """Runs `batch` requests of `new_tokens` through the engine; (median full-batch step period, steps timed)."""
    names = adapter_names(case, batch)
    records.clear()
    serve(engine, [bench_request(f"{case}-{batch}-{i}", word_prompt(i, PROMPT_TOKENS), new_tokens,
                                 names[i % len(names)], RANK) for i in range(batch)])
    periods = [later - earlier for (earlier, a), (later, b) in zip(records, records[1:])
               if a.num_prefills == b.num_prefills == 0 and len(a.request_ids) == len(b.request_ids) == batch]
    periods = periods[2:]  # the first steps after the prefill settle allocations
    return statistics.median(periods) * 1e3, len(periods)


def churn_lengths(count: int, new_tokens: int) -> list[int]:
    rng = random.Random(count)
    return [rng.randint(max(1, new_tokens // 3), 5 * new_tokens // 3) for _ in range(count)]


def churn_tokens_per_s(engine: Engine, case: str, running: int, new_tokens: int) -> tuple[float, int]:
    """4 x `running` requests of churn_lengths through `engine` (its max_num_seqs is `running`);
    (generated tokens per second, tokens)."""
    lengths = churn_lengths(4 * running, new_tokens)
    names = adapter_names(case, running)
    seconds = serve(engine, [bench_request(f"churn-{case}-{i}", word_prompt(i, PROMPT_TOKENS), length,
                                           names[i % len(names)], RANK) for i, length in enumerate(lengths)])
    return sum(lengths) / seconds, sum(lengths)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = suite_parser(__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--cases", choices=CASES, nargs="+", default=list(CASES))
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens each request generates in the loop")
    parser.add_argument("--steps", type=int, default=30, help="timed bare steps")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    rows, churn = run(torch.device(args.device), args.batches, args.cases, args.new_tokens, args.steps)
    report = {"steps": [{**vars(row), "host_ms": row.host_ms} for row in rows], "churn": [vars(row) for row in churn]}
    write_json(args.json, report)
    return report


def run(device: torch.device, batches: list[int], cases: list[str], new_tokens: int,
        steps: int) -> tuple[list[LoopRow], list[ChurnRow]]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; torch {torch.__version__}; prompt {PROMPT_TOKENS} tokens, {new_tokens} new", flush=True)
    tokenizer = bench_tokenizer()  # no EOS: requests run to max_tokens, as engine_bench's do
    parts = build(device, max(batches), tokenizer)
    bare = {(b, c): bare_step_ms(parts, b, c, steps) for b in batches for c in cases}
    records: list[tuple[float, StepRecord]] = []

    def async_then_sync(measure: Callable[[Engine], T]) -> tuple[T, T]:
        """`measure` on an engine with async scheduling, then on one without (one engine at a time)."""
        results = []
        for mode in (True, False):
            with running_engine(parts, tokenizer, RANK, mode,
                                on_step=lambda record: records.append((time.perf_counter(), record))) as engine:
                results.append(measure(engine))
        return results[0], results[1]

    rows = []
    for b in batches:
        for c in cases:
            fast, slow = async_then_sync(lambda engine: loop_step_ms(engine, records, b, c, new_tokens))
            rows.append(LoopRow(b, c, bare[(b, c)], *fast, *slow))
            print(rows[-1].line(), flush=True)
    churn = []
    for c in cases:
        (fast, tokens), (slow, _) = async_then_sync(lambda engine: churn_tokens_per_s(engine, c, max(batches),
                                                                                       new_tokens))
        churn.append(ChurnRow(c, 4 * max(batches), max(batches), tokens, fast, slow))
        print(churn[-1].line(), flush=True)
    return rows, churn


if __name__ == "__main__":
    main()
