"""Each worker prices itself: the performance model its steps follow, for the gateways' routing and its own
mode policy.

At start a worker takes, for its kind (device × base model: gpu_worker/device_kind.py) and its kernels'
tiling table: the operator's profile of this machine (`python -m gpu_worker.profile` writes
<cache>/<kind>.json, TESSERA_HOME/perf_models by default), else the model committed for its kind
(policy/perf_models), else one it fitted before (<cache>/<kind>-<kernels>.json), else
it fits one now by a short profile of its own model (SELF_GRID: seconds) and caches it. It reports the model in its state
stream (gpu_worker/state_push.py), so that a gateway prices it with its own model, never another kind's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

from gpu_worker.device_kind import device_name, perf_model_kind
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.profile import Grid, grid_plan, profile_model
from kernels.tiling import table_for
from policy.perf_model import PERF_MODELS_DIR, PerfModel, perf_model_path

log = logging.getLogger(__name__)

# Small enough for seconds on the device, wide enough to fit every term of each phase's forms.
SELF_GRID = Grid(prefill_batches=(1, 4), prompt_lens=(32, 256), decode_batches=(1, 8, 16), context_lens=(64, 512),
                 ranks=(8, 64), repeats=2)


def kernels_key(model: LlamaForCausalLM) -> str:
    """What the kernels' speed follows besides the device: the tiling table in use (none on a CPU)."""
    table = table_for(model.lm_head.weight.device)
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:12]


def resolve_perf_model(model: LlamaForCausalLM, base_model: str, max_lora_rank: int, lora_targets: list[str],
                       cache_dir: Path, committed_dir: Path = PERF_MODELS_DIR) -> PerfModel:
    """The model of this worker's kind: the operator's, committed, cached, or profiled now (and cached)."""
    kind = perf_model_kind(device_name(model.lm_head.weight.device), base_model)
    for chosen in (perf_model_path(kind, cache_dir), perf_model_path(kind, committed_dir)):
        if chosen.exists():
            log.info("perf model for %s: %s", kind, chosen)
            return PerfModel.load(chosen)
    cached = cache_dir / f"{kind}-{kernels_key(model)}.json"
    if cached.exists():
        try:
            loaded = PerfModel.load(cached)
            log.info("perf model for %s: %s (fitted by an earlier start)", kind, cached)
            return loaded
        except (OSError, ValueError, KeyError) as exc:
            log.warning("ignoring the cached perf model %s (%s): profiling again", cached, exc)
    grid = dataclasses.replace(SELF_GRID, ranks=tuple(sorted({min(r, max_lora_rank) for r in SELF_GRID.ranks})))
    log.info("no perf model for %s: profiling this worker (%d compositions x %d passes, ranks %s)", kind,
             len(grid_plan(grid)), grid.repeats, ", ".join(map(str, grid.ranks)))
    fitted = profile_model(model, base_model, grid, log.debug, "the worker's own profile at start",
                           lora_targets=lora_targets)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    fitted.save(tmp)
    os.replace(tmp, cached)
    log.info("perf model for %s fitted (prefill %s R²=%.3f, decode %s R²=%.3f): %s", kind, fitted.prefill.form,
             fitted.prefill.r2 or 0.0, fitted.decode.form, fitted.decode.r2 or 0.0, cached)
    return fitted
