"""Which inference mode each step runs in: decided once per step, before the model runner runs it.

Two modes: UNMERGED, where the LoRA kernels apply each token's adapter over the base weights, and
MERGED (VaLoRA's merged inference), where one adapter is folded into the base weights and the step
runs base-only (lora/merge_switch.py does the folding). A step is merged when every one of its
tokens uses one adapter and that adapter has already filled `merge_after_steps` steps in a row, so
that a mix that only briefly looks uniform does not pay for a merge and an unmerge. It stays merged
while the steps stay on that adapter; the first step that needs anything else (another adapter, the
base model, a mix) runs unmerged. A switch that found no memory for its backups at start keeps every
step unmerged.

Running example, merge_after_steps=2, each step's adapter (slot 3, "sql"):
    sql sql sql sql base sql
    U   U   M   M   U    U      (the streak restarts at the base step)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gpu_worker.lora.merge_switch import MergeSwitch
from gpu_worker.scheduler import ScheduledBatch
from kernels import NO_SLOT


class InferenceMode(enum.Enum):
    UNMERGED = "unmerged"  # LoRA kernels over the base weights; any mix of adapters
    MERGED = "merged"      # one adapter folded into the base weights; no LoRA kernels
    MIXTURE = "mixture"    # one adapter folded in; the other tokens add their delta and the merged one's negated


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


class Orchestrator:
    def __init__(self, merge_switch: MergeSwitch | None, merge_after_steps: int) -> None:
        """`merge_switch`: None when merged mode is off (every step runs unmerged)."""
        assert merge_switch is None or merge_after_steps >= 1, merge_after_steps
        self.merge_switch = merge_switch
        self._after_steps = merge_after_steps
        self._candidate: tuple[int, str] | None = None  # the uniform (slot, adapter) of the last step planned
        self._streak = 0                                # steps in a row on the candidate, that one included

    def plan(self, batch: ScheduledBatch) -> StepPlan:
        """The mode `batch` (a step about to launch) runs in."""
        switch = self.merge_switch
        if switch is None:
            return UNMERGED
        uniform = _uniform_adapter(batch)
        if uniform is not None and uniform == switch.merged:
            return _merged(uniform)
        self._streak = self._streak + 1 if uniform is not None and uniform == self._candidate else 1
        self._candidate = uniform
        if uniform is None or self._streak <= self._after_steps or not switch.available:
            return UNMERGED
        return _merged(uniform)


def _uniform_adapter(batch: ScheduledBatch) -> tuple[int, str] | None:
    """(slot, name) of the adapter every sequence of `batch` uses; None for the base model or a mix."""
    names = {item.seq.adapter.name if item.seq.adapter else None for item in batch.items}
    slots = {item.seq.slot for item in batch.items}
    if len(names) != 1 or None in names or len(slots) != 1 or NO_SLOT in slots:  # NO_SLOT: on CPU LoRA workers
        return None
    return slots.pop(), names.pop()


def _merged(adapter: tuple[int, str]) -> StepPlan:
    slot, name = adapter
    return StepPlan(InferenceMode.MERGED, name, slot)
