"""What a step of given candidates costs in each mode, from this worker kind's performance model.

The model (policy/perf_model.py, fitted by `python -m gpu_worker.profile` on the
device) prices a batch from its requests, tokens and adapter ranks. A mode changes what its LoRA
kernels run: merged, the merged adapter's requests cost what base-model requests cost; mixture, every
other request also runs the merged adapter's rank (its negated delta), and the merged adapter's
weights are read once more, as one more distinct adapter. A step holding both prompt and decode
tokens is priced as its prefill batch plus its decode batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from policy.mode_policies import Candidate, StepCost
from policy.batch_summary import BatchEntry, BatchSummary
from policy.perf_model import PERF_MODELS_DIR, PerfModel, perf_model_path

log = logging.getLogger(__name__)


def perf_model_cost(model: PerfModel) -> StepCost:
    def cost(candidates: Sequence[Candidate], merged: str | None, mixture: bool) -> float:
        merged_rank = max((c.rank for c in candidates if c.adapter == merged), default=0) if merged else 0
        phases = {True: BatchSummary(), False: BatchSummary()}
        mixed: set[bool] = set()  # phases with tokens that run the merged adapter negated
        for c in candidates:
            on_merged = merged is not None and c.adapter == merged
            summary = phases[c.prefill]
            summary.add(BatchEntry("" if on_merged else c.adapter or "", 0 if on_merged else c.rank, c.context + c.tokens))
            if mixture and not on_merged:  # its tokens also run the merged adapter's rank, negated
                summary.ranks += merged_rank
                summary.rank_tokens += merged_rank * (c.context + c.tokens)
                mixed.add(c.prefill)
        for phase in mixed:
            phases[phase].distinct_rank += merged_rank  # the merged adapter's weights, read once more
        prefill, decode = phases[True], phases[False]
        return (model.prefill_s(prefill) if prefill.requests else 0.0) + (model.decode_s(decode) if decode.requests else 0.0)
    return cost


def load_step_cost(kind: str, directory: Path = PERF_MODELS_DIR) -> StepCost | None:
    """The step cost of worker kind `kind` (gpu_worker/device_kind.py), if it has been profiled."""
    path = perf_model_path(kind, directory)
    if not path.exists():
        log.info("no performance model for %s (%s): merged mode pauses no request", kind, path)
        return None
    return perf_model_cost(PerfModel.load(path))
