"""Which mode the next step runs in, and which requests it may run: the orchestrator's policies.

Each policy looks at the step's candidates (running requests with tokens to run, and waiting ones)
and returns a `ModeDecision`: unmerged (every candidate may run), or merged on one adapter, whose
requests the step may run, with the other requests that may run beside it. A merged step that runs other requests' tokens too is a mixture step
(gpu_worker/orchestrator.py settles that once the scheduler has built the batch).

`CreditPolicy` is Tessera's: VaLoRA's Algorithm 1 priced with this worker's own costs.
- Each request's credit is its wait since its last token (or its arrival) plus the next step's time
  in the current mode, plus the switch's time when that mode does not serve it; it starves once its
  credit reaches θ times its objective for the next token (TTFT before the first, TPOT after).
- Unmerged while more than half the candidates starve, or no adapter holds more than half of them.
- Otherwise the top adapter is worth merging when its requests gain more time per token (a merged
  step against an unmerged one, from the step-cost model) than the requests it pauses lose (a token
  once a starvation period instead of once a step), and it is merged once those gains have paid for
  the switch (a merge and its restore, measured): the ski-rental rule, so that a brief run never pays
  for a switch. Starving requests of other adapters run beside it: mixture.
Without a step-cost model (no profile for this worker kind) it never pauses anyone: it merges only
when every candidate uses one adapter, once the steps' measured time has paid for the switch.

The baselines of benchmarks/modes_bench.py (VaLoRA's Figure 19): `UnmergedOnly`, `MergedOnly` (one
adapter merged at a time; the most starving request's adapter next) and `DLoRA` (dLoRA's threshold
switching: merge the top adapter while it holds β of the candidates; unmerged for a step once an
adapter's unserved credit, α per second waited, reaches its requests' objective).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass



class InferenceMode(enum.Enum):
    UNMERGED = "unmerged"  # LoRA kernels over the base weights; any mix of adapters
    MERGED = "merged"      # one adapter folded into the base weights; no LoRA kernels
    MIXTURE = "mixture"    # one adapter folded in; the other tokens add their delta and the merged one's negated


@dataclass(frozen=True)
class Candidate:
    """A request the next step could run."""
    seq_id: int
    adapter: str | None  # None: the base model
    slot: int | None     # its adapter's GPU slot; None while none is usable there (it cannot be merged)
    rank: int
    tokens: int          # tokens the step would run for it: a prompt (chunk), or 1 when decoding
    context: int         # tokens before those: what its attention reads
    waited_s: float      # since its last token, or its arrival
    slo_s: float         # its objective for the next token: TTFT before the first, TPOT after

    @property
    def prefill(self) -> bool:
        return self.tokens > 1 or self.context == 0


@dataclass(frozen=True)
class ModeView:
    candidates: Sequence[Candidate]
    merged: tuple[int, str] | None  # (slot, adapter) folded into the weights now
    mixture: bool                   # mixture steps are possible (the stacks keep a mixture slot)
    switch_s: float                 # a merge plus its restore, as measured
    step_s: float                   # the recent steps' time, as measured


@dataclass(frozen=True)
class ModeDecision:
    mode: InferenceMode                    # UNMERGED or MERGED
    merged: tuple[int, str] | None = None  # MERGED: (slot, adapter) to fold in
    also: frozenset[int] = frozenset()     # MERGED: seq ids of other requests that run beside it (mixture)
    starving: int = 0                      # candidates past their credit threshold

    def __post_init__(self) -> None:
        assert self.mode is not InferenceMode.MIXTURE, "mixture is the merged step's batch, not a decision"
        assert (self.mode is InferenceMode.MERGED) == (self.merged is not None), self


UNMERGED_ALL = ModeDecision(InferenceMode.UNMERGED)

# (candidates, merged adapter or None, mixture) -> seconds the step takes: policy/mode_costs.py
StepCost = Callable[[Sequence[Candidate], str | None, bool], float]


class ModePolicy:
    name = ""

    def decide(self, view: ModeView) -> ModeDecision:
        raise NotImplementedError


class UnmergedOnly(ModePolicy):
    name = "unmerged"

    def decide(self, view: ModeView) -> ModeDecision:
        return UNMERGED_ALL


class CreditPolicy(ModePolicy):
    name = "credit"

    def __init__(self, theta: float, cost: StepCost | None) -> None:
        assert theta > 0, theta
        self.theta = theta
        self._cost = cost
        self._paid = 0.0  # request-seconds the top adapter's run would have saved merged so far
        self._top: str | None = None

    def decide(self, view: ModeView) -> ModeDecision:
        candidates = view.candidates
        if not candidates:
            return _hold(view)
        starving = {c.seq_id for c in candidates if self._credit(c, view) >= self.theta * c.slo_s}
        top = _top_adapter(candidates, view.merged)
        if top is None or 2 * len(starving) > len(candidates) or 2 * _count(candidates, top) <= len(candidates):
            return self._unmerged(len(starving))
        others_starving = any(c.seq_id in starving and c.adapter != top[1] for c in candidates)
        if others_starving and not view.mixture:  # they could run beside it only in mixture steps
            return self._unmerged(len(starving))
        served = [c for c in candidates if c.adapter == top[1] or c.seq_id in starving]
        rent = self._rent(candidates, served, view, top[1])
        if view.merged != top:  # ski rental: unmerged steps pay the rent until it adds up to the switch
            if rent <= 0 or self._top != top[1]:
                self._paid = 0.0
            self._top = top[1]
            if rent <= 0 or self._paid < view.switch_s * len(candidates):  # every candidate waits through it
                self._paid += max(rent, 0.0)
                return self._unmerged(len(starving))
        elif rent < 0:
            return self._unmerged(len(starving))
        return ModeDecision(InferenceMode.MERGED, top, frozenset(c.seq_id for c in served if c.adapter != top[1]),
                            len(starving))

    def _unmerged(self, starving: int) -> ModeDecision:
        return ModeDecision(InferenceMode.UNMERGED, starving=starving)

    def _credit(self, c: Candidate, view: ModeView) -> float:
        switch = view.merged is not None and c.adapter != view.merged[1] and not view.mixture
        return c.waited_s + view.step_s + (view.switch_s if switch else 0.0)

    def _rent(self, candidates: Sequence[Candidate], served: list[Candidate], view: ModeView, top: str) -> float:
        """What merging `top` (the steps running `served`) saves over unmerged steps of every candidate,
        in the candidates' time per token, summed: the served requests' tokens come a cheaper step apart;
        a paused request's once a starvation period (θ times its objective) instead of a step apart."""
        ids = {c.seq_id for c in served}
        paused = [c for c in candidates if c.seq_id not in ids]
        if self._cost is None:  # no model of what LoRA costs here: the whole step bounds it; pause nobody
            return -1.0 if paused else len(candidates) * view.step_s
        unmerged = self._cost(candidates, None, False)
        merged = self._cost(served, top, any(c.adapter != top for c in served))
        return len(served) * (unmerged - merged) - sum(max(self.theta * c.slo_s, merged) - unmerged for c in paused)


class MergedOnly(ModePolicy):
    """Always merged: stay on the merged adapter while it has requests and none starves; then the
    adapter of the longest-waiting request against its objective."""
    name = "merged"

    def __init__(self, theta: float) -> None:
        self.theta = theta

    def decide(self, view: ModeView) -> ModeDecision:
        mergeable = [c for c in view.candidates if c.adapter is not None and c.slot is not None]
        if not mergeable:
            return UNMERGED_ALL  # base-model requests, or adapters still loading
        current = view.merged if view.merged is not None and _count(mergeable, view.merged) else None
        worst = max(mergeable, key=lambda c: c.waited_s / c.slo_s)
        if current is None or (worst.adapter != current[1] and worst.waited_s >= self.theta * worst.slo_s):
            current = (worst.slot, worst.adapter)
        return ModeDecision(InferenceMode.MERGED, current)


class DLoRA(ModePolicy):
    """dLoRA's threshold switching, as VaLoRA's baseline runs it: merge the top adapter while it holds
    at least β of the candidates; an adapter left out gains α credit a second, and once an adapter's
    credit reaches its requests' objective the step runs unmerged for all (its credit spent)."""
    name = "dlora"

    def __init__(self, alpha: float = 1.0, beta: float = 0.5) -> None:
        self.alpha, self.beta = alpha, beta
        self._credit: dict[str | None, float] = {}

    def decide(self, view: ModeView) -> ModeDecision:
        candidates = view.candidates
        top = _top_adapter(candidates, view.merged)
        for adapter in {c.adapter for c in candidates}:
            served = top is not None and adapter == top[1]
            self._credit[adapter] = 0.0 if served else self._credit.get(adapter, 0.0) + self.alpha * view.step_s
        due = [c for c in candidates if self._credit.get(c.adapter, 0.0) >= c.slo_s]
        if top is None or due or _count(candidates, top) < self.beta * len(candidates):
            self._credit.clear()
            return ModeDecision(InferenceMode.UNMERGED, starving=len(due))
        return ModeDecision(InferenceMode.MERGED, top)


def make_policy(name: str, theta: float, cost: StepCost | None) -> ModePolicy:
    """The policy a worker's `mode_policy` names. Raises ValueError for an unknown name."""
    policies: dict[str, Callable[[], ModePolicy]] = {
        "credit": lambda: CreditPolicy(theta, cost), "unmerged": UnmergedOnly,
        "merged": lambda: MergedOnly(theta), "dlora": DLoRA}
    if name not in policies:
        raise ValueError(f"expected one of {', '.join(policies)}, got {name!r}")
    return policies[name]()


def _hold(view: ModeView) -> ModeDecision:
    """No candidate: keep the weights as they are."""
    return ModeDecision(InferenceMode.MERGED, view.merged) if view.merged else UNMERGED_ALL


def _top_adapter(candidates: Sequence[Candidate], merged: tuple[int, str] | None) -> tuple[int, str] | None:
    """(slot, adapter) with the most mergeable candidates (ties: the merged one); None if none is."""
    counts = Counter((c.slot, c.adapter) for c in candidates if c.adapter is not None and c.slot is not None)
    if not counts:
        return None
    return max(counts, key=lambda key: (counts[key], key == merged))


def _count(candidates: Sequence[Candidate], adapter: tuple[int, str]) -> int:
    return sum(1 for c in candidates if c.adapter == adapter[1])
