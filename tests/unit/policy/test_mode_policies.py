"""The mode policies on hand-made candidates: Tessera's credit policy (VaLoRA's Algorithm 1 priced with
step costs) and the baselines of benchmarks/modes_bench.py."""

from __future__ import annotations

import pytest

from policy.mode_policies import (DLoRA, Candidate, CreditPolicy, InferenceMode, MergedOnly, ModeView,
                                  make_policy)

STEP_S = 0.010
SLOTS = {"sql": 3, "chat": 5, "vision": 6}


def _cands(*adapters: str | None, waited_s: float = 0.0, slo_s: float = 1.0, first_id: int = 0) -> list[Candidate]:
    return [Candidate(first_id + i, a, SLOTS[a] if a else None, 8, 1, 100, waited_s, slo_s) for i, a in enumerate(adapters)]


def _view(candidates, merged: str | None = None, switch_s: float = 2 * STEP_S, mixture: bool = True) -> ModeView:
    return ModeView(candidates, (SLOTS[merged], merged) if merged else None, mixture, switch_s, STEP_S)


def _cost(candidates, merged, mixture) -> float:
    """A step: 5 ms, 0.1 ms a request, 1 ms for each distinct adapter the LoRA kernels run (the merged one
    again in mixture steps)."""
    lora = {c.adapter for c in candidates if c.adapter is not None and c.adapter != merged}
    return 0.005 + 0.0001 * len(candidates) + 0.001 * (len(lora) + (mixture and merged is not None))


def _run(policy, steps: list[tuple[list[Candidate], ...]]) -> str:
    """Decide each step, the weights following the decisions: M(erged) or U(nmerged) a step."""
    merged, letters = None, ""
    for (candidates,) in steps:
        decision = policy.decide(_view(candidates, merged))
        merged = decision.merged[1] if decision.merged else None
        letters += "M" if merged else "U"
    return letters


def test_without_costs_one_adapters_run_merges_once_its_steps_have_paid_for_the_switch():
    """Ski rental: the switch costs two steps' time for every candidate, and a merged step is assumed to
    save at most its whole time: merged at the third step of the run."""
    policy = CreditPolicy(theta=1.0, cost=None)
    assert _run(policy, [(_cands("sql", "sql"),)] * 4) == "UUMM"


def test_without_costs_nobody_is_paused_so_a_mix_stays_unmerged():
    policy = CreditPolicy(theta=1.0, cost=None)
    assert _run(policy, [(_cands("sql", "sql", "sql", "chat"),)] * 5) == "UUUUU"


def test_a_base_model_request_or_a_new_adapter_starts_the_rent_over():
    policy = CreditPolicy(theta=1.0, cost=None)
    steps = [(_cands("sql"),), (_cands(None),), (_cands("sql"),), (_cands("chat"),), (_cands("chat"),), (_cands("chat"),)]
    assert _run(policy, steps) == "UUUUUM"


def test_with_costs_the_top_adapter_merges_and_pauses_the_others_when_they_lose_less_than_it_gains():
    """Nine sql requests and one chat held to 20 ms a token: merged steps take 5.9 ms against 8 ms, so sql's
    nine gain 2.1 ms a token each and chat loses 12 ms (a token each 20 ms instead of each 8 ms): 6.9 ms a
    step, which pays a 1 ms switch for ten requests in two steps."""
    policy = CreditPolicy(theta=1.0, cost=_cost)
    candidates = _cands(*["sql"] * 9) + _cands("chat", slo_s=0.02, first_id=9)
    decisions = [policy.decide(_view(candidates, merged, switch_s=0.001)) for merged in (None, None, None, "sql")]
    assert [d.mode for d in decisions[:3]] == [InferenceMode.UNMERGED] * 2 + [InferenceMode.MERGED]
    assert decisions[2].merged == (SLOTS["sql"], "sql") and decisions[2].also == frozenset()
    assert decisions[3].mode is InferenceMode.MERGED
    # Held to 100 ms a token, chat would lose more than sql gains: never merged.
    patient = _cands(*["sql"] * 9) + _cands("chat", slo_s=0.1, first_id=9)
    assert {CreditPolicy(1.0, _cost).decide(_view(patient, None, switch_s=0.0)).mode} == {InferenceMode.UNMERGED}


def test_with_costs_pausing_many_for_few_does_not_pay():
    """Four sql requests against three others on two adapters: pausing three costs more than sql gains."""
    policy = CreditPolicy(theta=1.0, cost=_cost)
    assert _run(policy, [(_cands("sql", "sql", "sql", "sql", "chat", "chat", "vision"),)] * 6) == "UUUUUU"


def test_a_starving_request_of_another_adapter_runs_beside_the_merged_one():
    policy = CreditPolicy(theta=1.0, cost=_cost)
    candidates = _cands(*["sql"] * 9) + _cands("chat", waited_s=0.5, slo_s=0.4, first_id=9)
    decision = policy.decide(_view(candidates, "sql"))
    assert decision.mode is InferenceMode.MERGED and decision.also == frozenset({9}) and decision.starving == 1
    # Without mixture steps it could not run beside it: the step runs unmerged.
    assert policy.decide(_view(candidates, "sql", mixture=False)).mode is InferenceMode.UNMERGED


def test_unmerged_once_more_than_half_starve_or_no_adapter_holds_more_than_half():
    policy = CreditPolicy(theta=1.0, cost=_cost)
    starving = _cands("sql", "sql", "sql", waited_s=2.0) + _cands("chat", first_id=3)
    assert policy.decide(_view(starving, "sql")).mode is InferenceMode.UNMERGED
    assert policy.decide(_view(starving, "sql")).starving == 3
    assert policy.decide(_view(_cands("sql", "sql", "chat", "vision"), "sql")).mode is InferenceMode.UNMERGED


def test_theta_scales_the_objective_a_credit_is_held_to():
    """Waited 50 ms + a 10 ms step: starving at θ = 0.5 of a 100 ms objective, not at θ = 1."""
    candidates = _cands(*["sql"] * 9) + _cands("chat", waited_s=0.05, slo_s=0.1, first_id=9)
    assert CreditPolicy(theta=0.5, cost=_cost).decide(_view(candidates, "sql")).also == frozenset({9})
    assert CreditPolicy(theta=1.0, cost=_cost).decide(_view(candidates, "sql")).also == frozenset()


def test_merged_only_stays_on_its_adapter_until_another_request_starves():
    policy = MergedOnly(theta=1.0)
    calm = _cands("sql", "sql", "chat")
    assert policy.decide(_view(calm, "sql")).merged == (SLOTS["sql"], "sql")
    assert policy.decide(_view(calm)).merged is not None
    starving = _cands("sql", "sql") + _cands("chat", waited_s=3.0, first_id=2)
    assert policy.decide(_view(starving, "sql")).merged == (SLOTS["chat"], "chat")
    assert policy.decide(_view(_cands(None))).mode is InferenceMode.UNMERGED  # nothing to merge


def test_dlora_merges_the_top_adapter_at_beta_and_runs_unmerged_once_an_adapter_is_due():
    policy = DLoRA(alpha=1.0, beta=0.5)
    assert policy.decide(_view(_cands("sql", "sql", "chat", "vision"))).merged == (SLOTS["sql"], "sql")
    assert policy.decide(_view(_cands("sql", "chat", "vision"))).mode is InferenceMode.UNMERGED
    # chat's credit grows α·step a step it is left out; at its 25 ms objective the step is unmerged.
    policy = DLoRA(alpha=1.0, beta=0.5)
    modes = [policy.decide(_view(_cands("sql", "sql", "sql") + _cands("chat", slo_s=0.025, first_id=3), "sql")).mode
             for _ in range(4)]
    assert modes == [InferenceMode.MERGED, InferenceMode.MERGED, InferenceMode.UNMERGED, InferenceMode.MERGED]


def test_an_unknown_policy_name_is_refused():
    with pytest.raises(ValueError, match="expected one of credit, unmerged, merged, dlora"):
        make_policy("fastest", 1.0, None)
