"""policy/routing/policies.py and tessera_policy.py: each baseline's defining behaviour, and the
Tessera policy's cache affinity, SLO protection and rank awareness."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from policy.adapter_tiers import LoadCosts, Tier
from policy.batch_summary import BatchEntry
from policy.perf_model import PerfModel, PhaseModel
from policy.routing.policies import (FirstFit, LeastLoadedLRUAffinity, MostIdle, RandomChoice, RoundRobin,
                                     RoutingRequest, Slo)
from policy.routing.tessera_policy import TesseraPolicy, adapter_load_s
from policy.routing.worker_state import WorkerState

PREFILL = PhaseModel("prefill", "tessera", {"intercept": 5e-3, "tokens": 20e-6, "tokens_sq": 0.0,
                                            "rank_tokens": 0.0, "distinct_rank": 0.0}, None, 0)
# Step = 5 ms + 0.2 µs per context token + 0.5 µs per rank: 5.2 ms for one 1000-token request of rank 8.
DECODE = PhaseModel("decode", "tessera", {"intercept": 5e-3, "requests": 0.0, "tokens": 0.2e-6,
                                          "sum_ranks": 0.5e-6, "distinct_rank": 0.0}, None, 0)
MODEL = PerfModel("test-gpu", "test", PREFILL, DECODE)
PADDED = PerfModel("padded-gpu", "test", PREFILL,
                   PhaseModel("decode", "batch_max_rank", {"intercept": 5e-3, "batch_max_rank": 2e-6}, None, 0))


def worker(address: str, load: int = 0, gpu: tuple[str, ...] = (), host: tuple[str, ...] = (), rank: int = 8,
           context: int = 1000, kind: str = "test-gpu", slo: float | None = None,
           loading: tuple[str, ...] = (), victim_rate: float = 0.0) -> WorkerState:
    running = tuple(BatchEntry(f"{address}-r{i}", rank, context) for i in range(load))
    return WorkerState(address=address, base_model="llama", kind=kind, running=running, queued=(),
                       gpu_adapters=frozenset(gpu), host_adapters=frozenset(gpu + host), gpu_adapter_slots=32,
                       max_batch=64, free_kv_tokens=100_000, tightest_tpot_slo_s=slo, timestamp=0.0,
                       loading_adapters=frozenset(loading), gpu_victim_rate=victim_rate)


def request(adapter: str = "x", rank: int = 8, tpot_s: float = 7.5e-3, ttft_s: float = 0.5) -> RoutingRequest:
    return RoutingRequest(adapter, rank, prompt_tokens=1000, expected_output_tokens=200, slo=Slo(tpot_s, ttft_s))


def tessera(model: PerfModel = MODEL) -> TesseraPolicy:
    return TesseraPolicy({model.kind: model}, LoadCosts(), headroom=1.0, sole_holder_headroom=1.0)


def picks(policy, workers: list[WorkerState], n: int, req: RoutingRequest | None = None) -> list[str]:
    return [policy.choose(req or request(), workers).address for _ in range(n)]


# ---- baselines ---------------------------------------------------------------------------------

def test_round_robin_cycles_in_order() -> None:
    assert picks(RoundRobin(), [worker("w1", 5), worker("w2"), worker("w3")], 6) == ["w1", "w2", "w3"] * 2


def test_random_is_seeded_and_spreads() -> None:
    workers = [worker(f"w{i}") for i in range(4)]
    first = picks(RandomChoice(seed=7), workers, 80)
    assert first == picks(RandomChoice(seed=7), workers, 80)
    assert first != picks(RandomChoice(seed=8), workers, 80)
    assert set(first) == {w.address for w in workers}


def test_most_idle_takes_the_fewest_running_plus_queued_and_rotates_ties() -> None:
    queued = worker("w2")
    queued = WorkerState(**{**queued.__dict__, "queued": (BatchEntry("q", 8, 10),) * 3})
    workers = [worker("w1", 2), queued, worker("w3", 1), worker("w4", 1)]
    assert Counter(picks(MostIdle(), workers, 4)) == Counter({"w3": 2, "w4": 2})


def test_first_fit_packs_the_first_worker_with_room_not_the_idlest() -> None:
    policy = FirstFit(max_batch=8)
    assert picks(policy, [worker("w1", 7), worker("w2", 0)], 1) == ["w1"]
    assert picks(policy, [worker("w1", 8), worker("w2", 3), worker("w3", 0)], 1) == ["w2"]
    assert picks(policy, [worker("w1", 9), worker("w2", 8), worker("w3", 12)], 1) == ["w2"]  # none fits: least loaded


def test_least_loaded_affinity_prefers_a_holder_within_the_slack() -> None:
    policy = LeastLoadedLRUAffinity(slack=2)
    near = [worker("w1", 2), worker("w2", 4, gpu=("x",)), worker("w3", 6, gpu=("x",))]
    assert picks(policy, near, 2) == ["w2", "w2"]
    far = [worker("w1", 2), worker("w2", 5, gpu=("x",))]
    assert picks(policy, far, 1) == ["w1"]
    host_only = [worker("w1", 2), worker("w2", 2, host=("x",))]   # affinity is to GPU residency
    assert set(picks(policy, host_only, 2)) == {"w1", "w2"}


# ---- Tessera ----------------------------------------------------------------------------------

def test_tessera_prefers_the_worker_holding_the_adapter_over_idle_ones() -> None:
    workers = [worker("w1"), worker("w2", load=3, gpu=("x",)), worker("w3")]
    assert picks(tessera(), workers, 3) == ["w2"] * 3
    assert picks(MostIdle(), workers, 2) == ["w1", "w3"]       # what a load-only policy does


def test_tessera_sends_a_miss_where_its_eviction_costs_least_not_only_where_it_adds_least() -> None:
    # Both miss; w1 runs a request, so r adds less to its steps than to idle w2's (whose first step pays the
    # intercept), but a load on w1 evicts an adapter requested every 2 s, on w2 one not requested for minutes.
    busy, idle = worker("w1", load=1, victim_rate=0.5), worker("w2", victim_rate=0.001)
    assert picks(tessera(), [busy, idle], 2) == ["w2"] * 2
    assert picks(tessera(), [worker("w1", load=1), worker("w2")], 2) == ["w1"] * 2  # free slots: no victim
    policy = tessera()
    cost = policy.eviction_cost_s(request(), busy)
    assert cost == pytest.approx((1 - math.exp(-0.5 * 60.0)) * LoadCosts().load_s(Tier.DISK, 8))
    hit = worker("w1", load=1, gpu=("x",), victim_rate=0.5)
    assert policy.eviction_cost_s(request(), hit) == 0.0  # a hit evicts nothing
    assert policy.eviction_cost_s(request(), worker("w1", loading=("x",), victim_rate=0.5)) == 0.0  # nor a load under way


def test_tessera_prefers_a_host_copy_to_a_disk_load() -> None:
    workers = [worker("w1", load=1), worker("w2", load=1, host=("x",)), worker("w3", load=1)]
    assert picks(tessera(), workers, 3) == ["w2"] * 3


def test_a_loading_adapter_is_priced_halfway_through_its_current_stage() -> None:
    costs = LoadCosts()
    disk_s, host_s = costs.disk_to_host_s(16), costs.host_to_gpu_s(16)
    priced = {name: adapter_load_s(costs, state, "x", 16) for name, state in {
        "gpu": worker("w", gpu=("x",)), "copying": worker("w", host=("x",), loading=("x",)),
        "host": worker("w", host=("x",)), "reading": worker("w", loading=("x",)), "disk": worker("w")}.items()}
    assert priced == pytest.approx({"gpu": 0.0, "copying": host_s / 2, "host": host_s,
                                    "reading": disk_s / 2 + host_s, "disk": disk_s + host_s})


def test_tessera_prefers_a_load_under_way_to_a_new_one_and_a_usable_adapter_to_both() -> None:
    reading, disk = worker("w1", load=1, loading=("x",)), worker("w2", load=1)
    assert picks(tessera(), [disk, reading], 2) == ["w1"] * 2
    copying, host = worker("w3", load=1, host=("x",), loading=("x",)), worker("w4", load=1, host=("x",))
    assert picks(tessera(), [host, copying], 2) == ["w3"] * 2
    assert picks(tessera(), [copying, worker("w5", load=1, gpu=("x",))], 2) == ["w5"] * 2


def test_tessera_leaves_a_holder_whose_batch_would_break_the_tpot_slo() -> None:
    # w1 holds x but runs 11 requests: a step of 5 + 12 × (0.2 + 0.004) ms ≈ 7.45 ms, plus prefills
    # spread over 200 tokens, is over 7.5 ms. w2 has room (3 requests) but must load x from host.
    workers = [worker("w1", load=11, gpu=("x",)), worker("w2", load=3, host=("x",))]
    assert picks(tessera(), workers, 1) == ["w2"]
    relaxed = request(tpot_s=20e-3)                               # a looser SLO: affinity wins again
    assert picks(tessera(), workers, 1, relaxed) == ["w1"]


def test_tessera_keeps_a_request_on_its_adapters_only_holder_within_a_thinner_margin() -> None:
    # With r, w1's 6 requests predict 5 + 6 × (0.204 + 25 / 200) ≈ 6.97 ms per token: past the
    # 0.85 × 7.5 = 6.4 ms headroom, within the only holder's 0.95 × 7.5 = 7.1 ms. w2 is idle, with a
    # host copy of x.
    policy = TesseraPolicy({MODEL.kind: MODEL}, LoadCosts(), headroom=0.85)
    sole = [worker("w1", load=5, gpu=("x",)), worker("w2", host=("x",))]
    assert picks(policy, sole, 2) == ["w1", "w1"]               # leaving it would be a miss and a replica
    strict = TesseraPolicy({MODEL.kind: MODEL}, LoadCosts(), headroom=0.85, sole_holder_headroom=0.85)
    assert picks(strict, sole, 1) == ["w2"]                     # the margin everywhere: it spills
    replicated = sole + [worker("w3", load=5, gpu=("x",))]      # x on two GPUs: the margin holds on both
    assert picks(policy, replicated, 2) == ["w2", "w2"]
    over = [worker("w1", load=8, gpu=("x",)), worker("w2", host=("x",))]  # 8.0 ms: past the SLO itself
    assert picks(policy, over, 1) == ["w2"]


def test_tessera_sole_holder_headroom_lies_between_the_headroom_and_the_slo() -> None:
    for sole_holder_headroom in (0.8, 1.1):
        with pytest.raises(AssertionError, match="sole holder"):
            TesseraPolicy({MODEL.kind: MODEL}, LoadCosts(), headroom=0.85, sole_holder_headroom=sole_holder_headroom)


def test_tessera_protects_the_tightest_slo_already_on_a_worker() -> None:
    loose = request(tpot_s=50e-3)
    workers = [worker("w1", load=4, gpu=("x",), slo=5.5e-3), worker("w2", load=4, host=("x",))]
    assert picks(tessera(), workers, 1, loose) == ["w2"]
    workers = [worker("w1", load=4, gpu=("x",), slo=50e-3), worker("w2", load=4, host=("x",))]
    assert picks(tessera(), workers, 1, loose) == ["w1"]


def test_tessera_is_rank_aware_under_a_padded_kernel_model() -> None:
    # Padded kernels: a rank-8 request joining rank-128 requests is computed at rank 128.
    workers = [worker("w1", load=4, rank=128, kind="padded-gpu"), worker("w2", load=4, rank=8, kind="padded-gpu")]
    assert picks(tessera(PADDED), workers, 2, request(rank=8)) == ["w2", "w2"]
    assert set(picks(MostIdle(), workers, 2)) == {"w1", "w2"}     # equal loads: blind to ranks


def test_tessera_picks_the_least_bad_when_every_worker_breaks_the_slo() -> None:
    workers = [worker("w1", load=30, gpu=("x",)), worker("w2", load=20, gpu=("x",))]
    assert picks(tessera(), workers, 1) == ["w2"]


def test_tessera_skips_a_worker_without_kv_room() -> None:
    full = WorkerState(**{**worker("w1", gpu=("x",)).__dict__, "free_kv_tokens": 500})
    assert picks(tessera(), [full, worker("w2", host=("x",))], 1) == ["w2"]


def test_tessera_prices_each_kind_with_its_own_model_including_models_added_later() -> None:
    models = {MODEL.kind: MODEL}
    policy = TesseraPolicy(models, LoadCosts(), headroom=1.0, sole_holder_headroom=1.0)
    with pytest.raises(KeyError):
        policy.model_for(PADDED.kind)  # never another kind's model
    models[PADDED.kind] = PADDED  # a worker of that kind reported its own (gateway/state_feed.py)
    assert policy.model_for(PADDED.kind) is PADDED and policy.model_for(MODEL.kind) is MODEL
