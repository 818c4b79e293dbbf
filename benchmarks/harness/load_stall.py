"""Streams decoding through a running Engine while other requests arrive at a fixed interval: the
streams' per-token gaps inside the arrivals' window, and each arrival's time to first token
(benchmarks/cold_start_bench.py's "no stall" measurement: arrivals whose adapters must load, or not), and
the engine's steps (StepLog) to tell slow steps from late deliveries."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import time
from dataclasses import dataclass

from benchmarks.harness.serving import first_token_s
from gpu_worker.engine import Engine, StepRecord
from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.adapter_stats import AdapterTierStats

WAIT_S = 600.0  # for the streams' first tokens (their adapters load first), and for a stall to end


@dataclass(frozen=True)
class WindowResult:
    gaps_s: list[float]          # per stream token of the window: the gap it ended, over the tokens it came with
    spans: list[tuple[float, float, int]]  # each gap behind gaps_s: (began, ended, tokens), perf_counter
    stream_tpot_s: list[float]   # per stream: its mean gap over the window (its TPOT there)
    arrival_ttft_s: list[float]  # each arrival, submit to first token
    window_s: float
    disk_loads: int              # adapter loads from disk that finished inside the window
    gpu_evictions: int
    started_at: float            # the window, in time.perf_counter()
    ended_at: float


class StepLog:
    """The engine's steps as they end (its on_step hook, on the engine thread): when each was launched."""

    def __init__(self) -> None:
        self._steps: list[tuple[float, StepRecord]] = []  # (launched at, record)

    def __call__(self, record: StepRecord) -> None:
        self._steps.append((time.perf_counter() - record.duration_s, record))

    def launched_between(self, start: float, end: float) -> list[StepRecord]:
        return [record for at, record in list(self._steps) if start <= at < end]

    def prefill_launches(self) -> list[float]:
        """When each step that ran prompt tokens was launched, in order."""
        return [at for at, record in list(self._steps) if record.num_prefills]

    def first_launch(self, request_id: str) -> float:
        """When the first step that ran `request_id` was launched."""
        return next(at for at, record in list(self._steps) if request_id in record.request_ids)


async def stall_window(engine: Engine, streams: list[GenerationRequest], arrivals: list[GenerationRequest],
                       interval_s: float, warm_tokens: int) -> WindowResult:
    """Start `streams` (long outputs); once each has `warm_tokens` tokens, submit arrival k at
    window start + k * interval_s; the window ends one interval after the last arrival. Once every
    stream has a token from after the window (a stall that began inside it has ended), abort the
    streams and wait for every arrival's token."""
    loop = asyncio.get_running_loop()
    outputs: list[list[tuple[float, int]]] = [[] for _ in streams]  # per stream: (received at, tokens)
    ended = [False] * len(streams)  # reached max_tokens, aborted or failed
    warm, past = asyncio.Event(), asyncio.Event()
    end = math.inf

    def check() -> None:
        if all(done or len(o) >= warm_tokens for o, done in zip(outputs, ended)):
            warm.set()
        if all(done or (o and o[-1][0] > end) for o, done in zip(outputs, ended)):
            past.set()

    async def stream(i: int, request: GenerationRequest) -> None:
        try:
            async for out in engine.submit(request, loop):
                if out.token_ids:
                    outputs[i].append((time.perf_counter(), len(out.token_ids)))
                    check()
        finally:  # a failed stream is raised by the gather below, not waited for
            ended[i] = True
            check()

    tasks = [asyncio.create_task(stream(i, request)) for i, request in enumerate(streams)]
    await asyncio.wait_for(warm.wait(), WAIT_S)
    start, tiers = time.perf_counter(), engine.stats().adapters
    arriving = []
    for k, request in enumerate(arrivals):
        await asyncio.sleep(max(0.0, start + k * interval_s - time.perf_counter()))
        arriving.append(asyncio.create_task(first_token_s(engine, request)))
    await asyncio.sleep(max(0.0, start + len(arrivals) * interval_s - time.perf_counter()))
    end, after = time.perf_counter(), engine.stats().adapters
    await asyncio.wait_for(past.wait(), WAIT_S)
    for request in streams:
        engine.abort(request.request_id)
    await asyncio.gather(*tasks)
    ttfts = await asyncio.gather(*arriving)
    # Every gap that overlaps the window, once per token it brought.
    in_window = [[(t0, t1, n) for (t0, _), (t1, n) in itertools.pairwise(out) if t1 > start and t0 < end]
                 for out in outputs]
    spans = [span for stream_spans in in_window for span in stream_spans]
    gaps = [(t1 - t0) / n for t0, t1, n in spans for _ in range(n)]
    tpots = [sum(t1 - t0 for t0, t1, _ in stream_spans) / sum(n for _, _, n in stream_spans)
             for stream_spans in in_window if stream_spans]
    return WindowResult(gaps, spans, tpots, list(ttfts), end - start, _disk_loads(after) - _disk_loads(tiers),
                        after.gpu_evictions - tiers.gpu_evictions, start, end)


def decode_only_gaps(spans: list[tuple[float, float, int]], prefill_launches: list[float]) -> list[float]:
    """The per-token gaps of `spans` during which no step with prompt tokens was launched: what loads
    beside serving may slow, apart from the cost of the arrivals' own prefills (which a window whose
    arrivals wait for loads has fewer of)."""
    kept = []
    for t0, t1, n in spans:
        i = bisect.bisect_right(prefill_launches, t0)
        if i == len(prefill_launches) or prefill_launches[i] >= t1:
            kept.extend([(t1 - t0) / n] * n)
    return kept


def _disk_loads(tiers: AdapterTierStats) -> int:
    return sum(times.count for times in tiers.loads if times.source == "disk")
