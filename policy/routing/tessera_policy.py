"""Tessera's routing policy: rank-aware (CaraServe), SLO-aware, and adapter-cache-aware (ROCK).

For a request r and a worker w (its reported batch B = running + queued, plus our own dispatches):
  cost(w) = prefill(r) / E[output] + (decode(B + r) - decode(B))   what r adds to every step of w
          + load(tier of r's adapter on w)                          GPU 0, host ~ms, disk ~100 ms;
                                                                    what is left of a load under way
          + eviction(w)                                             if r's adapter must come onto w's
                                                                    full GPU tier: what its victim loses
          + PENALTY                                                 if r, or the tightest SLO already
                                                                    on w, would miss its SLO there
and the cheapest worker wins. Predicted time per token on w with r:
  tpot = decode(B + r) + Σ_{b in B + r} prefill(b alone) / E[output]
— in steady state each member of the batch was admitted once, and its prefill stalled the others'
decode once, spread over a response's length. Predicted time to first token:
  ttft = max(load, step + prefill(queued)) + step + prefill(r),   step = decode(B)
(the step in flight, the queued prompts ahead of r — while the adapter loads — then r's own step).
Both are held to `headroom` × the SLO: the policy cannot see the arrivals that will come after r.
Load time is the cache affinity: a worker that holds the adapter wins until it would break an SLO,
then the request spills to the next best, which loads the adapter — a replica, where demand is.
The margin is priced by what leaving costs. Where r's adapter is on the GPU of several workers,
leaving one mostly means another holder takes r: the margin is cheap. Where w is its only holder,
leaving means a cache miss, a load in r's TTFT (from disk, 30-200 ms, unless another worker has a
host copy) and a second replica of an adapter one worker has been enough for (what fills w is
mostly other adapters' requests, not r's). So the only holder is held to `sole_holder_headroom` ×
the SLO, a thinner margin (default 0.98: with the registry's placement, the 60-worker simulation's
setting that keeps >= 99% within SLO and 0.952-0.970 of the hit-rate ceiling at Zipf 0.8, 1.1 and 1.4,
docs/benchmarks/routing.md): r leaves it only when its SLO all but breaks there. An
adapter with several holders still spills at the margin: that is how hot adapters' replicas multiply.
A cache miss costs more than its own load: on a full GPU tier it evicts the worker's coldest adapter,
whose next request there misses in turn. Each worker reports that victim's expected rate λ
(AdapterTiers.gpu_victim_rate), and a miss on w is charged a load from disk times the chance the victim
is requested within `victim_horizon_s`, 1 - exp(-λ · horizon). Without it a miss goes where r adds the
least to the steps, a worker already running (on an idle one r's first step pays the whole step), so
at light load the busy workers' tiers churn while the idle ones' sit unused; with it misses go where
the coldest adapters are, as one cluster-wide LFU would (docs/benchmarks/routing.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from policy.adapter_tiers import LoadCosts, Tier
from policy.batch_summary import BatchSummary
from policy.perf_model import PerfModel
from policy.routing.policies import Rotation, RoutingRequest
from policy.routing.worker_state import WorkerState

PENALTY_S = 1e3  # above any real cost: an SLO-breaking placement loses to every other


def adapter_load_s(costs: LoadCosts, worker: WorkerState, adapter: str, rank: int) -> float:
    """Seconds until `adapter` is usable on `worker`'s GPU. A load under way (the worker reports it
    loading) is priced halfway through its current stage, disk -> host or host -> GPU, plus the stages
    after it: the gateway does not see when it started, and a start uniform over the stage leaves half
    of it on average. So a loading adapter is cheaper than one the worker would have to start loading,
    and dearer than one already usable."""
    tier = worker.tier(adapter)
    load_s = costs.load_s(tier, rank)
    if adapter not in worker.loading_adapters or tier is Tier.GPU:
        return load_s
    stage_s = costs.host_to_gpu_s(rank) if tier is Tier.HOST else costs.disk_to_host_s(rank)
    return load_s - stage_s / 2


@dataclass(frozen=True)
class Prediction:
    added_s: float  # what r adds to w's steps, per output token, plus its adapter's load
    tpot_s: float   # time per output token on w with r
    ttft_s: float   # r's time to first token on w


class TesseraPolicy:
    name = "tessera"

    def __init__(self, models: Mapping[str, PerfModel], load_costs: LoadCosts, headroom: float = 0.85,
                 sole_holder_headroom: float = 0.98, victim_horizon_s: float = 60.0) -> None:
        """`models`: each worker kind's performance model, read when a worker is priced, so models added
        later (those workers report: gateway/state_feed.py) price theirs; a worker is priced with its own
        kind's model only (the state feed routes no worker whose kind has none).
        `sole_holder_headroom`: the share of the SLO the prediction may use on the only worker that
        holds the request's adapter on its GPU (see the module docstring).
        `victim_horizon_s`: how far ahead an evicted adapter's lost requests count (the workers' LFU
        half-life by default: what their eviction already looks back over)."""
        assert 0 < headroom <= 1, "headroom is the fraction of the SLO the prediction may use"
        assert headroom <= sole_holder_headroom <= 1, "a sole holder's margin lies between headroom's and none"
        assert victim_horizon_s >= 0
        self._models = models
        self._load_costs = load_costs
        self.headroom = headroom
        self.sole_holder_headroom = sole_holder_headroom
        self.victim_horizon_s = victim_horizon_s
        self._rotation = Rotation()

    def model_for(self, kind: str) -> PerfModel:
        return self._models[kind]

    def choose(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> WorkerState:
        own_prefill = {kind: self.own_prefill_s(request, kind) for kind in {w.kind for w in candidates}}
        holders = [w.address for w in candidates if request.adapter in w.gpu_adapters]
        sole = holders[0] if len(holders) == 1 else None
        return self._rotation.pick_min(candidates, key=lambda w: self.cost(
            request, w, own_prefill[w.kind], self.sole_holder_headroom if w.address == sole else self.headroom))

    def own_prefill_s(self, request: RoutingRequest, kind: str) -> float:
        """`request`'s prompt alone on a worker of `kind` (the third argument of `predict` and `cost`)."""
        return self.model_for(kind).prefill_s(BatchSummary.of([request.entry]))

    def predict(self, request: RoutingRequest, worker: WorkerState, own_prefill_s: float) -> Prediction:
        model = self.model_for(worker.kind)
        out = max(1, request.expected_output_tokens)
        batch = worker.batch
        after = batch.plus(request.entry)
        step, step_after = model.decode_s(batch), model.decode_s(after)
        load_s = adapter_load_s(self._load_costs, worker, request.adapter, request.rank)
        return Prediction(added_s=own_prefill_s / out + (step_after - step) + load_s,
                          tpot_s=step_after + model.prefill.predict_alone(after) / out,
                          ttft_s=max(load_s, step + model.prefill_s(worker.queued_batch)) + step + own_prefill_s)

    def cost(self, request: RoutingRequest, worker: WorkerState, own_prefill_s: float, headroom: float) -> float:
        """`headroom`: the share of the SLO the prediction may use on `worker` (`choose` picks it)."""
        predicted = self.predict(request, worker, own_prefill_s)
        cost = predicted.added_s + self.eviction_cost_s(request, worker)
        tightest = worker.tightest_tpot_slo_s
        tpot_slo = request.slo.tpot_s if tightest is None else min(request.slo.tpot_s, tightest)
        overshoot = max(predicted.tpot_s / tpot_slo, predicted.ttft_s / request.slo.ttft_s) / headroom
        room = (worker.load < worker.max_batch and worker.free_kv_tokens - worker.queued_batch.tokens
                >= request.prompt_tokens + max(1, request.expected_output_tokens))
        if overshoot > 1 or not room:
            cost += PENALTY_S * (1 + overshoot)  # among bad choices, the least bad
        return cost

    def eviction_cost_s(self, request: RoutingRequest, worker: WorkerState) -> float:
        """What bringing `request`'s adapter onto `worker`'s GPU costs the adapter it evicts there: a load
        from disk, in the chance that adapter is requested within the horizon (0 for a hit, a load under
        way, or a free slot). Priced as from disk, not from the host copy it keeps: priced by the copy, the
        term recovered less than half the hits in the live benchmark's setting (docs/benchmarks/routing.md)."""
        if request.adapter in worker.gpu_adapters or request.adapter in worker.loading_adapters:
            return 0.0
        lost = 1.0 - math.exp(-worker.gpu_victim_rate * self.victim_horizon_s)
        return lost * self._load_costs.load_s(Tier.DISK, request.rank)
