"""Each step's inference mode, and the batch it allows: decided before the scheduler builds the step
(`shape`) and settled on the batch it built (`plan`).

Three modes (VaLoRA): UNMERGED, where the LoRA kernels apply each token's adapter over the base
weights; MERGED, where one adapter is folded into the base weights and the step runs base-only
(lora/merge_switch.py does the folding); MIXTURE (deLoRA), the merged weights with other requests
beside the merged adapter's, each of their tokens adding its own adapter's delta and the merged
one's negated. Which mode, and which requests a merged step runs, is the policy's choice
(mode_policies.py; the worker's `mode_policy`). A merged decision lets the scheduler run the merged
adapter's requests and the few others the policy names; the step is MERGED if only the former ran,
MIXTURE otherwise. Without a merge switch (merged mode off, or no memory for its backups at start)
every step runs unmerged and nobody is held back.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpu_worker.lora.merge_switch import MergeSwitch
from policy.cold_start import ColdStartPolicy
from policy.mode_policies import UNMERGED_ALL, Candidate, InferenceMode, ModePolicy, ModeView
from gpu_worker.scheduler import ScheduledBatch, Scheduler
from gpu_worker.sequence import Sequence
from kernels import NO_SLOT

__all__ = ["UNMERGED", "InferenceMode", "Orchestrator", "Slos", "StepPlan"]


@dataclass(frozen=True)
class StepPlan:
    """How one step runs."""
    mode: InferenceMode
    merged_adapter: str | None = None  # MERGED, MIXTURE: the adapter folded into the base weights
    merged_slot: int = NO_SLOT         # MERGED, MIXTURE: its adapter slot

    def __post_init__(self) -> None:
        merged = self.mode is not InferenceMode.UNMERGED
        assert merged == (self.merged_adapter is not None) == (self.merged_slot != NO_SLOT), self


UNMERGED = StepPlan(InferenceMode.UNMERGED)


@dataclass(frozen=True)
class Slos:
    """The objectives of requests that came without their own."""
    ttft_s: float
    tpot_s: float


class Orchestrator:
    def __init__(self, merge_switch: MergeSwitch | None, policy: ModePolicy, slos: Slos, cold_start: ColdStartPolicy,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """`merge_switch`: None when merged mode is off. `cold_start`: the scheduler's, whose smoothing of the
        engine's step times serves the credits too."""
        self.merge_switch = merge_switch if merge_switch is not None and merge_switch.available else None
        self.policy = policy
        self._slos = slos
        self._cold_start = cold_start
        self._clock = clock
        self._decision = UNMERGED_ALL
        self.starving = 0  # candidates past their credit threshold at the last decision

    def shape(self, scheduler: Scheduler) -> Callable[[Sequence], bool] | None:
        """Decide the next step's mode; -> which sequences the scheduler may run in it (None: any)."""
        switch = self.merge_switch
        if switch is None:
            return None
        view = ModeView(self._candidates(scheduler), switch.merged, switch.mixture_slot >= 0, switch.switch_s,
                        self._cold_start.step_s)
        decision = self._decision = self.policy.decide(view)
        self.starving = decision.starving
        if decision.merged is None:
            return None
        name, also = decision.merged[1], decision.also
        return lambda seq: (seq.adapter is not None and seq.adapter.name == name) or seq.seq_id in also

    def plan(self, batch: ScheduledBatch) -> StepPlan:
        """The mode `batch` (built under the last `shape`) runs in."""
        decision = self._decision
        if self.merge_switch is None or decision.merged is None:
            return UNMERGED
        slot, name = decision.merged
        alone = all(item.seq.slot == slot and item.seq.adapter is not None and item.seq.adapter.name == name
                    for item in batch.items)
        return StepPlan(InferenceMode.MERGED if alone else InferenceMode.MIXTURE, name, slot)

    def _candidates(self, scheduler: Scheduler) -> list[Candidate]:
        """The running sequences with tokens to run, then the waiting ones in queue order, up to the
        step's sequence limit."""
        now = self._clock()
        running = [seq for seq in scheduler.running if not seq.sampled_all]
        room = max(0, scheduler.limits.max_num_seqs - len(scheduler.running))
        candidates = [self._candidate(seq, None if seq.slot == NO_SLOT else seq.slot, seq.rank, now) for seq in running]
        for seq in itertools.islice(scheduler.waiting, room):
            placed = scheduler.adapters.resident(seq.adapter) if seq.adapter is not None else None
            candidates.append(self._candidate(seq, *(placed or (None, 0)), now))
        return candidates

    def _candidate(self, seq: Sequence, slot: int | None, rank: int, now: float) -> Candidate:
        first = not seq.output_token_ids
        slo = (seq.ttft_slo_s or self._slos.ttft_s) if first else (seq.tpot_slo_s or self._slos.tpot_s)
        return Candidate(seq.seq_id, seq.adapter.name if seq.adapter else None, slot, rank, max(1, seq.num_pending),
                         seq.num_cached, now - seq.last_token_s, slo)
