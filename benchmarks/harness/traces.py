"""The shared conv trace (shared/data/AzureLLMInferenceTrace_conv.csv: arrival times, prompt and output
lengths of real requests) as the suites replay it: prompt lengths at its quantiles, and its first
requests paced to a rate.

    lengths, source = prompt_lengths(TRACE, count=8, max_length=2048)
    plan = arrivals_at_rate(TRACE, rate=6.0, duration_s=15.0, max_prompt=2048, max_output=128,
                            adapters=lambda count: rng.integers(0, 16, count))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from policy.simulator.workload import load_trace

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "AzureLLMInferenceTrace_conv.csv"
LENGTH_CAP = 2048
# The conv trace's ContextTokens at quantiles (i + 0.5) / 16, capped at 2048: used where the trace is absent.
TRACE_LENGTHS = (165, 206, 374, 391, 401, 412, 818, 1001, 1037, 1067, 1100, 1147, 1312, 1770, 2048, 2048)


def prompt_lengths(trace: Path, count: int, max_length: int) -> tuple[list[int], str]:
    """`count` prompt lengths at evenly spaced quantiles of the trace's ContextTokens, capped at
    LENGTH_CAP and scaled to `max_length`; -> (lengths, where they came from)."""
    if trace.is_file():
        values, source = sorted(load_trace(trace).prompt.tolist()), str(trace)
    else:
        values, source = list(TRACE_LENGTHS), f"built-in quantiles of the conv trace ({trace} not found)"
    picked = [values[int((i + 0.5) / count * len(values))] for i in range(count)]
    return [max(2, round(min(n, LENGTH_CAP) * max_length / LENGTH_CAP)) for n in picked], source


@dataclass(frozen=True)
class Arrival:
    at_s: float
    adapter: int  # which of the suite's adapters (its popularity rank)
    prompt: int
    output: int


def arrivals_at_rate(trace: Path, rate: float, duration_s: float, max_prompt: int, max_output: int,
                     adapters: Callable[[int], Sequence[int]]) -> list[Arrival]:
    """The trace's first requests, their times scaled to `rate` per second on average over `duration_s`,
    their prompt and output lengths capped; request i on adapters(count)[i]."""
    count = round(rate * duration_s)
    source = load_trace(trace, max_requests=count + 1)
    if len(source) <= count:
        raise ValueError(f"{trace} has {len(source)} requests; a run at {rate:g}/s for {duration_s:g} s "
                         f"needs {count + 1}")
    times = source.arrival_s * duration_s / source.arrival_s[count]  # the trace's pattern, at `rate` on average
    picks = adapters(count)
    return [Arrival(float(times[i]), int(picks[i]), int(min(source.prompt[i], max_prompt)),
                    int(min(source.output[i], max_output))) for i in range(count)]
