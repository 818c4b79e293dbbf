"""How a cold request starts: its adapter is in host memory, not yet usable on the GPU.

Three ways, priced each scheduling pass from what the worker measures, not constants:
  PIPELINED  admitted now while its adapter's copy onto the GPU runs; each projection's kernels wait on
             the device for that projection's own bytes (gpu_memory.py), so the copy of later layers
             overlaps the compute of earlier ones. The step is late only by what the copy has left
             beyond the step's own time (`copy_left_s - step_s`), and so is everyone in it.
  CPU        admitted now with its LoRA deltas computed by the CPU LoRA workers from the host copy
             (cpu_assist.py) until the adapter is usable on the GPU, then the GPU kernels (CaraServe).
             The step is late by what the CPU path adds to it (measured per job by the pool).
  WAIT       admitted at the first pass after the whole adapter is usable: nothing else waits for it.
The `auto` policy takes the one that starts the request first among those that keep the requests
already running within their TPOT objective (the tightest of theirs, as the gateway sent them, or the
worker's default): a step late by `stall` takes step_s + stall. With no GPU
placement yet (every GPU adapter byte held by running requests) WAIT has no bound, and CPU assistance
is the only way to start now. The single-way policies are the baselines of benchmarks/cold_start_bench.py.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

POLICIES = ("auto", "pipelined", "cpu", "wait")
STEP_EWMA = 0.1  # weight of the newest step in the running estimate of a step's time


class ColdStart(enum.StrEnum):
    PIPELINED = "pipelined"
    CPU = "cpu"
    WAIT = "wait"


# Among ways that start a request equally soon: the one that costs the others least.
PREFERENCE = (ColdStart.PIPELINED, ColdStart.WAIT, ColdStart.CPU)


@dataclass(frozen=True)
class ColdOptions:
    """What starting one cold request would cost now."""
    copy_left_s: float | None  # its copy onto the GPU still to run; None: no GPU placement yet
    cpu_extra_s: float | None  # what CPU assistance adds to a step; None: no CPU LoRA worker ready
    others: bool               # whether requests already running share its step
    tpot_slo_s: float | None = None  # the tightest TPOT objective among them (None: the policy's default)


class ColdStartPolicy:
    def __init__(self, policy: str, tpot_slo_s: float) -> None:
        if policy not in POLICIES:
            raise ValueError(f"cold-start policy {policy!r}: expected one of {', '.join(POLICIES)}")
        self.policy = policy
        self.tpot_slo_s = tpot_slo_s
        self.step_s = 0.0  # a step's time as the engine measures it, smoothed
        self.started = dict.fromkeys(ColdStart, 0)  # cold requests admitted, by the way they started

    def observe_step(self, seconds: float) -> None:
        self.step_s = seconds if not self.step_s else (1 - STEP_EWMA) * self.step_s + STEP_EWMA * seconds

    def choose(self, options: ColdOptions) -> ColdStart:
        """The way to start a cold request now; WAIT: leave it waiting this pass."""
        ways = self._ways(options)
        if self.policy != "auto":
            return ColdStart(self.policy) if ColdStart(self.policy) in ways else ColdStart.WAIT
        slo_s = options.tpot_slo_s or self.tpot_slo_s
        allowed = {way: late for way, (late, stall) in ways.items()
                   if not options.others or stall == 0 or self.step_s + stall <= slo_s}
        return min(allowed, key=lambda way: (allowed[way], PREFERENCE.index(way)))

    def _ways(self, options: ColdOptions) -> dict[ColdStart, tuple[float, float]]:
        """way -> (how late it starts the request beside a resident adapter, how late it makes the step)."""
        ways = {ColdStart.WAIT: (math.inf, 0.0)}
        if options.copy_left_s is not None:
            stall = max(0.0, options.copy_left_s - self.step_s)
            ways[ColdStart.PIPELINED] = (stall, stall)
            ways[ColdStart.WAIT] = (options.copy_left_s + self.step_s, 0.0)  # the copy, then the next pass
        if options.cpu_extra_s is not None:
            ways[ColdStart.CPU] = (options.cpu_extra_s, options.cpu_extra_s)
        return ways
