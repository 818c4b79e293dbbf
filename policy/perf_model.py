"""Per worker kind: predicted prefill time and decode-iteration time of a batch, fitted from profiles.

A model is linear in a few terms of the batch. Forms on offer (each with an intercept):
  sum_ranks       t = a·Σranks + b                    (the literature's padding-free kernels)
  batch_max_rank  t = a·|batch|·max rank + b          (padded kernels)
  tessera         prefill: b + a1·Σtokens + a2·Σtokens² + a3·Σ(rank·tokens) + a4·Σ_distinct rank
                  decode:  b + a1·|batch| + a2·Σcontext + a3·Σranks + a4·Σ_distinct rank
Tessera's own form follows where its step time goes (docs/benchmarks/engine.md): base matmuls per
token, attention per context token (KV reads) or per token² (causal prefill), LoRA work per
rank·token, and each distinct adapter's weights read once per step (Σ_distinct rank).
`fit_phase` fits every form by least squares (coefficients >= 0) and keeps the one with the best
adjusted R², so a form with more terms wins only when the terms pay for themselves.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from services.common.config import ConfigError
from policy.batch_summary import BatchEntry, BatchSummary

# Where a profiled worker kind's model is written (`python -m gpu_worker.profile`) and where the
# gateway reads every kind by name: `<kind>.json`, in a package neither role owns.
PERF_MODELS_DIR = Path(__file__).resolve().parent / "perf_models"

Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, ...] = ("prefill", "decode")


@dataclass(frozen=True)
class Term:
    batch: str  # the BatchSummary attribute holding the term's value for the whole batch
    alone: str  # the BatchSummary attribute holding the sum of its values over each entry on its own


TERMS: dict[str, Term] = {
    "intercept": Term("one", "requests"),
    "requests": Term("requests", "requests"),
    "tokens": Term("tokens", "tokens"),
    "tokens_sq": Term("tokens_sq", "tokens_sq"),
    "rank_tokens": Term("rank_tokens", "rank_tokens"),
    "sum_ranks": Term("ranks", "ranks"),
    "batch_max_rank": Term("requests_x_max_rank", "ranks"),
    "distinct_rank": Term("distinct_rank", "ranks"),
}

FORMS: dict[Phase, dict[str, tuple[str, ...]]] = {
    "prefill": {
        "sum_ranks": ("intercept", "sum_ranks"),
        "batch_max_rank": ("intercept", "batch_max_rank"),
        "tessera": ("intercept", "tokens", "tokens_sq", "rank_tokens", "distinct_rank"),
    },
    "decode": {
        "sum_ranks": ("intercept", "sum_ranks"),
        "batch_max_rank": ("intercept", "batch_max_rank"),
        "tessera": ("intercept", "requests", "tokens", "sum_ranks", "distinct_rank"),
    },
}


@dataclass(frozen=True)
class ProfileSample:
    """One measured step: prefill entries carry prompt tokens, decode entries context tokens."""

    phase: Phase
    entries: tuple[BatchEntry, ...]
    seconds: float


@dataclass(frozen=True)
class PhaseModel:
    phase: Phase
    form: str
    coefficients: dict[str, float]  # term -> seconds per unit of the term
    r2: float | None                # on the samples it was fitted to (None: not fitted, see source)
    samples: int
    r2_by_form: dict[str, float] = field(default_factory=dict)  # every form tried, for the report
    _batch_terms: Callable[[BatchSummary], tuple] = field(init=False, repr=False, compare=False)
    _alone_terms: Callable[[BatchSummary], tuple] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        terms = FORMS[self.phase].get(self.form)
        if terms is None:
            raise ValueError(f"unknown {self.phase} form '{self.form}'; known: {sorted(FORMS[self.phase])}")
        if tuple(self.coefficients) != terms:
            raise ValueError(f"{self.phase} form '{self.form}' takes terms {terms}, got {tuple(self.coefficients)}")
        # attrgetter over several names returns a tuple: every form has an intercept and another term.
        object.__setattr__(self, "_batch_terms", operator.attrgetter(*(TERMS[t].batch for t in terms)))
        object.__setattr__(self, "_alone_terms", operator.attrgetter(*(TERMS[t].alone for t in terms)))

    def predict(self, batch: BatchSummary) -> float:
        """Seconds for one step over `batch` (0 for an empty batch: no step runs)."""
        if batch.requests == 0:
            return 0.0
        return sum(map(operator.mul, self.coefficients.values(), self._batch_terms(batch)))

    def predict_alone(self, batch: BatchSummary) -> float:
        """Seconds the entries would take as one step each: Σ over entries of predict([entry])."""
        return sum(map(operator.mul, self.coefficients.values(), self._alone_terms(batch)))


def fit_form(phase: Phase, form: str, samples: Sequence[ProfileSample]) -> tuple[PhaseModel, float]:
    """Least-squares fit of one form; returns the model and its adjusted R²."""
    terms = FORMS[phase][form]
    if len(samples) <= len(terms):
        raise ValueError(f"{len(samples)} {phase} samples cannot fit the {len(terms)} terms of '{form}'")
    summaries = [BatchSummary.of(s.entries) for s in samples]
    x = np.array([[getattr(s, TERMS[t].batch) for t in terms] for s in summaries], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    # Every term is a cost, so coefficients are held >= 0: a term fitted negative (noise, or
    # collinearity within the profiled range) would predict negative time outside that range.
    # It is dropped and the others refitted, until none is negative.
    active = list(range(len(terms)))
    coef = np.zeros(len(terms))
    while active:
        fitted, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (fitted >= 0).all():
            coef[active] = fitted
            break
        del active[int(np.argmin(fitted))]
    residual = float(np.sum((y - x @ coef) ** 2))
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - residual / total if total > 0 else float(residual == 0.0)
    n, p = len(samples), len(terms)
    adjusted = 1.0 - (1.0 - r2) * (n - 1) / (n - p)
    model = PhaseModel(phase, form, {t: float(c) for t, c in zip(terms, coef)}, r2, n)
    return model, adjusted


def fit_phase(phase: Phase, samples: Sequence[ProfileSample]) -> PhaseModel:
    """Every form of `phase`, fitted; the best by adjusted R², with each form's R² recorded."""
    mine = [s for s in samples if s.phase == phase]
    fits = {form: fit_form(phase, form, mine) for form in FORMS[phase] if len(mine) > len(FORMS[phase][form])}
    if not fits:
        raise ValueError(f"too few {phase} samples ({len(mine)}) to fit any form")
    best = max(fits, key=lambda form: fits[form][1])
    model = fits[best][0]
    return PhaseModel(phase, model.form, model.coefficients, model.r2, model.samples,
                      {form: fit[0].r2 for form, fit in fits.items()})


@dataclass(frozen=True)
class PerfModel:
    """What one worker kind (device × base model × kernels) takes per step. Workers report `kind`."""

    kind: str
    device: str
    prefill: PhaseModel
    decode: PhaseModel
    source: str = ""  # where the numbers come from, for a model not fitted from samples

    def __post_init__(self) -> None:
        assert (self.prefill.phase, self.decode.phase) == PHASES, "prefill and decode models swapped"

    @classmethod
    def fit(cls, kind: str, device: str, samples: Sequence[ProfileSample]) -> PerfModel:
        return cls(kind, device, fit_phase("prefill", samples), fit_phase("decode", samples))

    def prefill_s(self, batch: BatchSummary) -> float:
        return self.prefill.predict(batch)

    def decode_s(self, batch: BatchSummary) -> float:
        return self.decode.predict(batch)

    def to_json(self) -> dict:
        phases = {phase: {"form": m.form, "coefficients": m.coefficients, "r2": m.r2, "samples": m.samples,
                          "r2_by_form": m.r2_by_form}
                  for phase, m in (("prefill", self.prefill), ("decode", self.decode))}
        return {"kind": self.kind, "device": self.device, "source": self.source, **phases}

    @classmethod
    def from_json(cls, data: dict) -> PerfModel:
        missing = {"kind", "device", *PHASES} - set(data)
        if missing:
            raise ValueError(f"perf model JSON lacks {sorted(missing)}")
        phases = {phase: PhaseModel(phase, d["form"], {t: float(c) for t, c in d["coefficients"].items()}, d.get("r2"),
                                    int(d["samples"]), dict(d.get("r2_by_form", {})))
                  for phase, d in ((p, data[p]) for p in PHASES)}
        return cls(data["kind"], data["device"], phases["prefill"], phases["decode"], data.get("source", ""))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> PerfModel:
        return cls.from_json(json.loads(Path(path).read_text()))


def perf_model_path(kind: str, directory: Path = PERF_MODELS_DIR) -> Path:
    return directory / f"{kind}.json"


def load_perf_models(directory: Path = PERF_MODELS_DIR) -> dict[str, PerfModel]:
    """Every `<kind>.json` in `directory`, by kind."""
    models = {}
    for path in sorted(directory.glob("*.json")):
        try:
            model = PerfModel.load(path)
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"perf model {path} is invalid: {exc}") from exc
        models[model.kind] = model
    return models
