"""The orchestrator's per-step decision: merge a run of steps on one adapter, unmerge at anything else."""

from __future__ import annotations

import pytest

from gpu_worker.lora.loader import AdapterRef
from gpu_worker.orchestrator import UNMERGED, InferenceMode, Orchestrator, StepPlan
from gpu_worker.scheduler import ScheduledBatch, ScheduledSeq
from gpu_worker.sequence import SamplingParams, Sequence
from kernels import NO_SLOT

SLOTS = {"sql": 3, "chat": 5}


class _Switch:
    """What the orchestrator reads of lora.merge_switch.MergeSwitch; `hold` is what the runner does."""

    def __init__(self, memory_for_backup: bool = True) -> None:
        self.merged: tuple[int, str] | None = None
        self.available = memory_for_backup  # the backups are reserved when the switch is made
        self.merges = 0

    def hold(self, plan: StepPlan) -> None:
        target = (plan.merged_slot, plan.merged_adapter) if plan.mode is InferenceMode.MERGED else None
        if target != self.merged:
            assert target is None or self.available, "merged without its backups"
            self.merged = target
            self.merges += target is not None


def _batch(*adapters: str | None) -> ScheduledBatch:
    batch = ScheduledBatch()
    for i, name in enumerate(adapters):
        ref = AdapterRef(name, "base", 8, "", "") if name else None
        seq = Sequence(f"r{i}", [1, 2], SamplingParams(), ref, None)
        seq.slot = SLOTS[name] if name else NO_SLOT
        batch.items.append(ScheduledSeq(seq, 1, True))
    return batch


def _modes(orchestrator: Orchestrator, switch: _Switch, steps: list[tuple[str | None, ...]]) -> str:
    """Plan and run each step; -> one letter a step for the mode it ran in: U(nmerged) or M(erged)."""
    letters = ""
    for adapters in steps:
        switch.hold(orchestrator.plan(_batch(*adapters)))
        letters += "M" if switch.merged else "U"
    return letters


def test_a_run_on_one_adapter_merges_after_merge_after_steps_steps_and_unmerges_at_the_base_model():
    switch = _Switch()
    steps = [("sql",), ("sql", "sql"), ("sql",), ("sql",), (None,), ("sql",)]
    assert _modes(Orchestrator(switch, merge_after_steps=2), switch, steps) == "UUMMUU"


def test_the_merged_plan_names_the_adapter_and_its_slot():
    switch = _Switch()
    orchestrator = Orchestrator(switch, merge_after_steps=1)
    _modes(orchestrator, switch, [("chat",)])
    assert orchestrator.plan(_batch("chat", "chat")) == StepPlan(InferenceMode.MERGED, "chat", SLOTS["chat"])


def test_another_adapter_unmerges_and_starts_its_own_streak():
    switch = _Switch()
    steps = [("sql",), ("sql",), ("chat",), ("chat",), ("chat",)]
    assert _modes(Orchestrator(switch, merge_after_steps=1), switch, steps) == "UMUMM"


def test_a_step_mixing_adapters_or_with_the_base_model_never_merges():
    switch = _Switch()
    steps = [("sql", "chat")] * 3 + [("sql", None)] * 3 + [(None,)] * 3
    assert _modes(Orchestrator(switch, merge_after_steps=1), switch, steps) == "U" * 9


def test_a_switch_without_memory_for_its_backups_keeps_every_step_unmerged():
    switch = _Switch(memory_for_backup=False)
    steps = [("sql",)] * 5
    assert _modes(Orchestrator(switch, merge_after_steps=1), switch, steps) == "UUUUU"
    assert switch.merges == 0


def test_without_a_merge_switch_every_step_runs_unmerged():
    orchestrator = Orchestrator(None, merge_after_steps=0)
    assert all(orchestrator.plan(_batch("sql")) == UNMERGED for _ in range(5))


def test_a_plan_is_merged_exactly_when_it_names_an_adapter_and_a_slot():
    with pytest.raises(AssertionError):
        StepPlan(InferenceMode.MERGED)
    with pytest.raises(AssertionError):
        StepPlan(InferenceMode.UNMERGED, "sql", 3)
