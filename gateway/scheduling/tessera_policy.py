"""Tessera's routing policy: rank-aware (CaraServe), SLO-aware, and adapter-cache-aware (ROCK).

For a request r and a worker w (its reported batch B = running + queued, plus our own dispatches):
  cost(w) = prefill(r) / E[output] + (decode(B + r) - decode(B))   what r adds to every step of w
          + load(tier of r's adapter on w)                          GPU 0, host ~ms, disk ~100 ms
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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.scheduling.adapter_cache import LoadCosts
from gateway.scheduling.batch import BatchSummary
from gateway.scheduling.perf_model import PerfModel
from gateway.scheduling.policies import Rotation, RoutingRequest
from gateway.scheduling.worker_state import WorkerState

PENALTY_S = 1e3  # above any real cost: an SLO-breaking placement loses to every other


class TesseraPolicy:
    name = "tessera"

    def __init__(self, models: Mapping[str, PerfModel], load_costs: LoadCosts, headroom: float = 0.85) -> None:
        assert 0 < headroom <= 1, "headroom is the fraction of the SLO the prediction may use"
        self._models = dict(models)
        self._load_costs = load_costs
        self._headroom = headroom
        self._rotation = Rotation()

    def choose(self, request: RoutingRequest, candidates: Sequence[WorkerState]) -> WorkerState:
        alone = BatchSummary.of([request.entry])
        own_prefill = {kind: m.prefill_s(alone) for kind, m in self._models.items()}
        return self._rotation.pick_min(candidates, key=lambda w: self.cost(request, w, own_prefill[w.kind]))

    def cost(self, request: RoutingRequest, worker: WorkerState, own_prefill_s: float) -> float:
        model = self._models[worker.kind]
        out = max(1, request.expected_output_tokens)
        batch = worker.batch
        after = batch.plus(request.entry)
        step, step_after = model.decode_s(batch), model.decode_s(after)
        load_s = self._load_costs.load_s(worker.tier(request.adapter), request.rank)
        cost = own_prefill_s / out + (step_after - step) + load_s

        tpot = step_after + model.prefill.predict_alone(after) / out
        ttft = max(load_s, step + model.prefill_s(worker.queued_batch)) + step + own_prefill_s
        tightest = worker.tightest_tpot_slo_s
        tpot_slo = request.slo.tpot_s if tightest is None else min(request.slo.tpot_s, tightest)
        overshoot = max(tpot / tpot_slo, ttft / request.slo.ttft_s) / self._headroom
        room = (worker.load < worker.max_batch
                and worker.free_kv_tokens - worker.queued_batch.tokens >= request.prompt_tokens + out)
        if overshoot > 1 or not room:
            cost += PENALTY_S * (1 + overshoot)  # among bad choices, the least bad
        return cost
