"""The simulated requests: arrivals and token counts from a real trace, adapters from a popularity model.

The Azure conversation trace has no adapter column, so each request draws its adapter from a Zipf
law over the adapters' popularity ranks; the rank -> adapter assignment drifts: every
`drift_every_min` of trace time a fraction `drift` of the ranking positions is reshuffled (a tail
adapter can become the head and the reverse). Each adapter has one LoRA rank, drawn once from
`rank_mix`. Timestamps are divided by `rate_scale` (2 = twice the trace's request rate), so the
drift is paced by trace time: the same requests see the same popularity whatever the rate.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from policy.batch_summary import BatchEntry, BatchSummary
from policy.perf_model import PerfModel
from policy.routing.policies import Slo

TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class Trace:
    arrival_s: np.ndarray  # [n] seconds since the first request, sorted
    prompt: np.ndarray     # [n] prompt tokens
    output: np.ndarray     # [n] generated tokens (>= 1)

    def __len__(self) -> int:
        return len(self.arrival_s)

    def capped(self, max_prompt: int | None, max_output: int | None, min_output: int = 1) -> Trace:
        """Prompts and outputs bounded (a small demo model's runs: benchmarks/placement_live.py)."""
        prompt = self.prompt if max_prompt is None else np.minimum(self.prompt, max_prompt)
        output = self.output if max_output is None else np.clip(self.output, min_output, max_output)
        return Trace(self.arrival_s, prompt, output)


def load_trace(path: Path, max_requests: int | None = None, duration_min: float | None = None) -> Trace:
    """The first `max_requests` rows, or the first `duration_min` minutes, of an Azure-format CSV."""
    if not path.is_file():
        raise FileNotFoundError(f"trace {path} not found: pass --trace PATH (an Azure LLM inference trace CSV "
                                f"with columns {', '.join(TRACE_COLUMNS)})")
    times, prompts, outputs = [], [], []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if not set(TRACE_COLUMNS) <= set(reader.fieldnames or ()):
            raise ValueError(f"{path}: expected columns {TRACE_COLUMNS}, found {reader.fieldnames}")
        for row in reader:
            if max_requests is not None and len(times) >= max_requests:
                break
            times.append(_seconds(row["TIMESTAMP"]))
            prompts.append(int(row["ContextTokens"]))
            outputs.append(max(1, int(row["GeneratedTokens"])))  # a request yields at least its first token
    if not times:
        raise ValueError(f"{path}: no requests")
    arrival = np.array(times) - times[0]
    if np.any(np.diff(arrival) < 0):
        raise ValueError(f"{path}: timestamps are not sorted")
    keep = arrival <= duration_min * 60 if duration_min is not None else slice(None)
    return Trace(arrival[keep], np.array(prompts)[keep], np.array(outputs)[keep])


def _seconds(timestamp: str) -> float:
    # "2023-11-16 18:15:46.6805900": 7 fraction digits, more than datetime parses.
    whole, _, fraction = timestamp.partition(".")
    return datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp() + (float(f"0.{fraction}") if fraction else 0.0)


@dataclass(frozen=True)
class Popularity:
    adapters: int
    skew: float                 # Zipf exponent over popularity ranks
    drift: float                # fraction of ranking positions reshuffled every period
    drift_every_min: float
    rank_mix: dict[int, float]  # LoRA rank -> weight

    def __post_init__(self) -> None:
        if self.adapters < 1:
            raise ValueError(f"need at least one adapter, got {self.adapters}")
        if self.skew < 0:
            raise ValueError(f"skew must be >= 0, got {self.skew}")
        if not 0 <= self.drift <= 1:
            raise ValueError(f"drift is a fraction in [0, 1], got {self.drift}")
        if self.drift_every_min <= 0:
            raise ValueError(f"drift period must be positive, got {self.drift_every_min} min")
        mix = self.rank_mix
        if not mix or any(r < 1 or w < 0 for r, w in mix.items()) or sum(mix.values()) <= 0:
            raise ValueError(f"rank mix needs positive ranks and non-negative weights summing > 0: {self.rank_mix}")

    def names(self) -> list[str]:
        return [f"a{i}" for i in range(self.adapters)]


def parse_rank_mix(text: str) -> dict[int, float]:
    """'8:1,16:1,128:2' -> {8: 1.0, 16: 1.0, 128: 2.0}."""
    try:
        return {int(r): float(w) for r, w in (part.split(":") for part in text.split(","))}
    except ValueError as e:
        raise ValueError(f"rank mix '{text}' is not RANK:WEIGHT[,RANK:WEIGHT...]") from e


@dataclass(frozen=True)
class SimRequest:
    index: int
    arrival_s: float  # virtual seconds
    prompt: int
    output: int
    adapter: str
    rank: int
    slo: Slo


def adapter_ranks(popularity: Popularity, seed: int) -> dict[str, int]:
    """Each adapter's LoRA rank, as `build_requests` with the same seed draws it."""
    return dict(zip(popularity.names(), _draw_ranks(popularity, np.random.default_rng(seed)).tolist()))


def build_requests(trace: Trace, popularity: Popularity, rate_scale: float, model: PerfModel,
                   tpot_slo_factor: float, ttft_slo_factor: float, seed: int, fixed_slo: Slo | None = None
                   ) -> list[SimRequest]:
    """Requests in arrival order. SLOs: a factor × what the request takes alone on an idle worker
    (decode step at its prompt's context; prefill of its prompt), from the same perf model; or
    `fixed_slo` for every request."""
    if rate_scale <= 0:
        raise ValueError(f"rate scale must be positive, got {rate_scale}")
    rng = np.random.default_rng(seed)
    ranks_of = _draw_ranks(popularity, rng)
    adapter_of = _drifting_adapters(trace, popularity, rng)
    names = popularity.names()
    requests = []
    for i in range(len(trace)):
        adapter, prompt = int(adapter_of[i]), int(trace.prompt[i])
        entry = BatchEntry(names[adapter], int(ranks_of[adapter]), prompt)
        alone = BatchSummary.of([entry])
        slo = fixed_slo or Slo(tpot_slo_factor * model.decode_s(alone), ttft_slo_factor * model.prefill_s(alone))
        requests.append(SimRequest(i, float(trace.arrival_s[i]) / rate_scale, prompt, int(trace.output[i]),
                                   entry.adapter, entry.rank, slo))
    return requests


def _draw_ranks(popularity: Popularity, rng: np.random.Generator) -> np.ndarray:
    """[adapters] LoRA rank per adapter: the generator's first draw, so `adapter_ranks` repeats it."""
    mix = popularity.rank_mix
    return rng.choice(list(mix), size=popularity.adapters, p=np.array(list(mix.values())) / sum(mix.values()))


def _drifting_adapters(trace: Trace, popularity: Popularity, rng: np.random.Generator) -> np.ndarray:
    """[n] adapter index per request: Zipf rank, through the ranking of the request's drift period."""
    n = popularity.adapters
    weights = np.arange(1, n + 1, dtype=np.float64) ** -popularity.skew
    rank = rng.choice(n, size=len(trace), p=weights / weights.sum())
    period = (trace.arrival_s // (popularity.drift_every_min * 60)).astype(np.int64)
    ranking = rng.permutation(n)  # ranking[k] = adapter at popularity rank k
    adapters = np.empty(len(trace), dtype=np.int64)
    for p in range(int(period[-1]) + 1):
        if p > 0:
            moved = rng.choice(n, size=round(popularity.drift * n), replace=False)
            ranking[moved] = ranking[rng.permutation(moved)]
        mask = period == p
        adapters[mask] = ranking[rank[mask]]
    return adapters
