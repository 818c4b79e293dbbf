"""The orchestrator between the policy and the scheduler: the candidates it shows the policy, which
sequences a decision lets run, and the mode of the batch the scheduler built."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from gpu_worker.lora.loader import AdapterRef
from policy.mode_policies import UNMERGED_ALL, InferenceMode, ModeDecision, ModePolicy, ModeView
from gpu_worker.orchestrator import UNMERGED, Orchestrator, Slos, StepPlan
from gpu_worker.scheduler import ScheduledBatch, ScheduledSeq
from gpu_worker.sequence import SamplingParams, Sequence
from kernels import NO_SLOT

SLOTS = {"sql": 3, "chat": 5}
SLOS = Slos(ttft_s=2.0, tpot_s=0.2)
COLD_START = SimpleNamespace(step_s=0.01)  # the smoothed step time is all the orchestrator reads of it


class _Policy(ModePolicy):
    def __init__(self, decision: ModeDecision) -> None:
        self.decision = decision
        self.views: list[ModeView] = []

    def decide(self, view: ModeView) -> ModeDecision:
        self.views.append(view)
        return self.decision


def _switch(merged: str | None = None):
    """What the orchestrator reads of lora.merge_switch.MergeSwitch."""
    return SimpleNamespace(available=True, merged=(SLOTS[merged], merged) if merged else None, mixture_slot=9,
                           switch_s=0.004)


def _seq(name: str | None, outputs: int = 0, tpot_slo_s: float | None = None) -> Sequence:
    ref = AdapterRef(name, "base", 8, "", "") if name else None
    seq = Sequence(f"r-{name}", [1, 2, 3], SamplingParams(max_tokens=8), ref, None)
    seq.output_token_ids = [7] * outputs
    seq.num_cached = seq.num_tokens - 1 if outputs else 0
    seq.slot = SLOTS[name] if name and outputs else NO_SLOT
    seq.rank = 8 if name and outputs else 0
    seq.tpot_slo_s = tpot_slo_s
    return seq


def _scheduler(running: list[Sequence], waiting: list[Sequence], max_num_seqs: int = 8):
    adapters = SimpleNamespace(resident=lambda ref: (SLOTS[ref.name], 8))
    return SimpleNamespace(running=running, waiting=deque(waiting), adapters=adapters,
                           limits=SimpleNamespace(max_num_seqs=max_num_seqs))


def _batch(*seqs: Sequence) -> ScheduledBatch:
    return ScheduledBatch([ScheduledSeq(seq, 1, True) for seq in seqs])


def test_the_policy_sees_running_then_waiting_sequences_up_to_the_sequence_limit():
    policy = _Policy(UNMERGED_ALL)
    running = [_seq("sql", outputs=2, tpot_slo_s=0.05), _seq(None, outputs=1)]
    waiting = [_seq("chat"), _seq("sql"), _seq("chat")]
    Orchestrator(_switch(), policy, SLOS, COLD_START).shape(_scheduler(running, waiting, max_num_seqs=4))
    (view,) = policy.views
    assert [(c.adapter, c.slot, c.tokens, c.slo_s) for c in view.candidates] == [
        ("sql", SLOTS["sql"], 1, 0.05), (None, None, 1, SLOS.tpot_s),  # TPOT: their next token is not the first
        ("chat", SLOTS["chat"], 3, SLOS.ttft_s), ("sql", SLOTS["sql"], 3, SLOS.ttft_s)]  # the prompt, against TTFT
    assert view.switch_s == 0.004 and view.mixture


def test_a_merged_decision_lets_its_adapters_requests_run_and_those_it_names():
    sql, chat, other_chat = _seq("sql", outputs=1), _seq("chat", outputs=1), _seq("chat", outputs=1)
    decision = ModeDecision(InferenceMode.MERGED, (SLOTS["sql"], "sql"), frozenset({chat.seq_id}), starving=1)
    orchestrator = Orchestrator(_switch(), _Policy(decision), SLOS, COLD_START)
    may_run = orchestrator.shape(_scheduler([sql, chat, other_chat], []))
    assert [may_run(s) for s in (sql, chat, other_chat)] == [True, True, False]
    assert orchestrator.starving == 1
    assert orchestrator.plan(_batch(sql)) == StepPlan(InferenceMode.MERGED, "sql", SLOTS["sql"])
    assert orchestrator.plan(_batch(sql, chat)) == StepPlan(InferenceMode.MIXTURE, "sql", SLOTS["sql"])


def test_an_unmerged_decision_lets_everything_run():
    orchestrator = Orchestrator(_switch("sql"), _Policy(UNMERGED_ALL), SLOS, COLD_START)
    assert orchestrator.shape(_scheduler([_seq("sql", outputs=1)], [])) is None
    assert orchestrator.plan(_batch(_seq("sql", outputs=1))) == UNMERGED


def test_without_a_merge_switch_or_its_backups_nothing_is_held_back_and_every_step_runs_unmerged():
    decision = ModeDecision(InferenceMode.MERGED, (SLOTS["sql"], "sql"))
    for switch in (None, SimpleNamespace(**{**vars(_switch()), "available": False})):
        policy = _Policy(decision)
        orchestrator = Orchestrator(switch, policy, SLOS, COLD_START)
        sql = _seq("sql", outputs=1)
        assert orchestrator.shape(_scheduler([sql], [])) is None
        assert orchestrator.plan(_batch(sql)) == UNMERGED and not policy.views


def test_a_plan_is_merged_exactly_when_it_names_an_adapter_and_a_slot():
    with pytest.raises(AssertionError):
        StepPlan(InferenceMode.MERGED)
    with pytest.raises(AssertionError):
        StepPlan(InferenceMode.UNMERGED, "sql", 3)
    with pytest.raises(AssertionError):
        ModeDecision(InferenceMode.MIXTURE, (3, "sql"))
