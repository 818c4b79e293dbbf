"""policy/perf_model.py and batch.py: running sums, least-squares fit and form choice,
JSON round trip, and the simulator's default model against the engine benchmark it came from."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from policy.batch_summary import BatchEntry, BatchSummary
from policy.perf_model import FORMS, TERMS, PerfModel, PhaseModel, ProfileSample, fit_phase

REPO = Path(__file__).resolve().parents[3]
RANKS = (8, 16, 32, 64, 128)


def random_batch(rng: random.Random, phase: str) -> tuple[BatchEntry, ...]:
    """Mixed ranks, some adapters shared (so Σranks != Σ_distinct ranks)."""
    size = rng.randint(1, 24) if phase == "decode" else rng.randint(1, 4)
    adapters = [(f"a{i}", rng.choice(RANKS)) for i in range(rng.randint(1, size))]
    tokens = (lambda: rng.randint(16, 3000)) if phase == "decode" else (lambda: rng.randint(16, 2048))
    return tuple(BatchEntry(a, r, tokens()) for a, r in (rng.choice(adapters) for _ in range(size)))


def direct_value(term: str, entries: tuple[BatchEntry, ...]) -> float:
    """Each term computed straight from its definition, not through BatchSummary."""
    distinct = {e.adapter: e.rank for e in entries}
    return {
        "intercept": 1.0,
        "requests": len(entries),
        "tokens": sum(e.tokens for e in entries),
        "tokens_sq": sum(e.tokens ** 2 for e in entries),
        "rank_tokens": sum(e.rank * e.tokens for e in entries),
        "sum_ranks": sum(e.rank for e in entries),
        "batch_max_rank": len(entries) * max(e.rank for e in entries),
        "distinct_rank": sum(distinct.values()),
    }[term]


def samples_from(phase: str, form: str, coefficients: dict[str, float], count: int, noise: float,
                 seed: int = 0) -> list[ProfileSample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        entries = random_batch(rng, phase)
        seconds = sum(c * direct_value(t, entries) for t, c in coefficients.items())
        samples.append(ProfileSample(phase, entries, seconds * (1 + rng.gauss(0, noise))))
    assert tuple(coefficients) == FORMS[phase][form]
    return samples


TESSERA_DECODE = {"intercept": 4.8e-3, "requests": 5e-6, "tokens": 0.2e-6, "sum_ranks": 0.3e-6,
                  "distinct_rank": 0.4e-6}
TESSERA_PREFILL = {"intercept": 5e-3, "tokens": 20e-6, "tokens_sq": 6e-10, "rank_tokens": 26e-9,
                   "distinct_rank": 0.35e-6}


def test_summary_sums_match_their_definitions_through_add_remove_and_advance() -> None:
    rng = random.Random(1)
    live: list[BatchEntry] = []
    summary = BatchSummary()
    for _ in range(300):
        if live and rng.random() < 0.3:
            gone = live.pop(rng.randrange(len(live)))
            summary.remove(gone)
        elif rng.random() < 0.3:
            summary.advance()
            live = [BatchEntry(e.adapter, e.rank, e.tokens + 1) for e in live]
        else:
            k = rng.randrange(6)
            entry = BatchEntry(f"a{k}", RANKS[k % len(RANKS)], rng.randint(1, 500))  # one rank per adapter
            live.append(entry)
            summary.add(entry)
        for term in TERMS:
            if live:
                assert getattr(summary, TERMS[term].batch) == direct_value(term, tuple(live)), term
    assert summary.distinct == len({e.adapter for e in live})


def test_plus_leaves_the_original_alone() -> None:
    base = BatchSummary.of([BatchEntry("a", 8, 10)])
    more = base.plus(BatchEntry("b", 64, 20))
    assert (base.requests, base.distinct_rank, base.max_rank) == (1, 8, 8)
    assert (more.requests, more.distinct_rank, more.max_rank) == (2, 72, 64)


@pytest.mark.parametrize("phase,coefficients", [("decode", TESSERA_DECODE), ("prefill", TESSERA_PREFILL)])
def test_fit_recovers_known_coefficients_and_picks_tessera_form(phase: str, coefficients: dict) -> None:
    model = fit_phase(phase, samples_from(phase, "tessera", coefficients, 200, noise=0.0))
    assert model.form == "tessera"
    assert model.r2 == pytest.approx(1.0)
    for term, value in coefficients.items():
        assert model.coefficients[term] == pytest.approx(value, rel=1e-6), term
    assert model.samples == 200
    assert model.r2_by_form["tessera"] > model.r2_by_form["sum_ranks"]


def test_fit_with_noise_stays_close_and_reports_r2_below_one() -> None:
    model = fit_phase("decode", samples_from("decode", "tessera", TESSERA_DECODE, 400, noise=0.02))
    assert model.form == "tessera"
    assert 0.9 < model.r2 < 1.0
    assert model.coefficients["intercept"] == pytest.approx(TESSERA_DECODE["intercept"], rel=0.05)
    assert model.coefficients["tokens"] == pytest.approx(TESSERA_DECODE["tokens"], rel=0.05)


@pytest.mark.parametrize("phase,form,coefficients", [
    ("decode", "batch_max_rank", {"intercept": 3e-3, "batch_max_rank": 2e-6}),
    ("prefill", "sum_ranks", {"intercept": 6e-3, "sum_ranks": 40e-6}),
])
def test_fit_picks_the_literature_form_that_generated_the_data(phase: str, form: str, coefficients: dict) -> None:
    model = fit_phase(phase, samples_from(phase, form, coefficients, 150, noise=0.01))
    assert model.form == form
    assert set(model.r2_by_form) == set(FORMS[phase])
    for term, value in coefficients.items():
        assert model.coefficients[term] == pytest.approx(value, rel=0.05)


def test_too_few_samples_is_an_error() -> None:
    with pytest.raises(ValueError, match="too few decode samples"):
        fit_phase("decode", samples_from("decode", "sum_ranks", {"intercept": 1e-3, "sum_ranks": 1e-6}, 2, 0.0))


def test_predictions_empty_batch_and_alone() -> None:
    model = PhaseModel("decode", "tessera", TESSERA_DECODE, None, 0)
    assert model.predict(BatchSummary()) == 0.0
    entries = random_batch(random.Random(3), "decode")
    alone = sum(model.predict(BatchSummary.of([e])) for e in entries)
    assert model.predict_alone(BatchSummary.of(entries)) == pytest.approx(alone)
    padded = PhaseModel("decode", "batch_max_rank", {"intercept": 1e-3, "batch_max_rank": 1e-6}, None, 0)
    alone = sum(padded.predict(BatchSummary.of([e])) for e in entries)
    assert padded.predict_alone(BatchSummary.of(entries)) == pytest.approx(alone)


def test_phase_model_rejects_terms_of_another_form() -> None:
    with pytest.raises(ValueError, match="takes terms"):
        PhaseModel("decode", "tessera", TESSERA_PREFILL, None, 0)
    with pytest.raises(ValueError, match="unknown decode form"):
        PhaseModel("decode", "cubic", {"intercept": 1.0}, None, 0)


def test_json_round_trip(tmp_path: Path) -> None:
    samples = (samples_from("decode", "tessera", TESSERA_DECODE, 50, 0.01)
               + samples_from("prefill", "tessera", TESSERA_PREFILL, 50, 0.01))
    model = PerfModel.fit("h200-test", "NVIDIA H200", samples)
    path = tmp_path / "model.json"
    model.save(path)
    data = json.loads(path.read_text())
    assert {"kind", "device", "prefill", "decode"} <= set(data)
    assert {"form", "coefficients", "r2", "samples"} <= set(data["decode"])
    loaded = PerfModel.load(path)
    assert loaded == model
    batch = BatchSummary.of(samples[0].entries)
    assert loaded.decode_s(batch) == model.decode_s(batch)


def test_default_sim_model_reproduces_the_engine_benchmark_it_was_derived_from() -> None:
    """docs/benchmarks/engine_bench-2026-11-21-h200.json: unmerged decode steps at context ~150."""
    model = PerfModel.load(REPO / "benchmarks" / "perf_models" / "h200-llama-2-7b.json")
    bench = json.loads((REPO / "docs" / "benchmarks" / "engine_bench-2026-11-21-h200.json").read_text())
    rows = [r for r in bench["rows"] if r["kind"] == "decode" and r["case"] in ("b_unmerged", "c_own_adapters")
            and not (r["case"] == "c_own_adapters" and r["batch"] == 1)]  # batch 1 of (c) ran merged
    for row in rows:
        adapters = [f"own{i}" if row["case"] == "c_own_adapters" else "shared" for i in range(row["batch"])]
        batch = BatchSummary.of(BatchEntry(a, 64, 150) for a in adapters)
        assert model.decode_s(batch) * 1e3 == pytest.approx(row["step_ms"], rel=0.05), row
    prefill = [r for r in bench["rows"] if r["kind"] == "prefill" and r["case"] == "own_adapters"][0]
    batch = BatchSummary.of(BatchEntry(f"own{i}", 64, 2048) for i in range(4))
    assert model.prefill_s(batch) == pytest.approx(prefill["seconds"], rel=0.02)


def test_a_term_fitted_negative_is_dropped_so_predictions_stay_positive() -> None:
    # Step time falls with rank here (noise, say): a free fit would give sum_ranks a negative slope.
    samples = [ProfileSample("decode", (BatchEntry("a", rank, 100),), 0.010 - rank * 1e-5) for rank in RANKS]
    model = fit_phase("decode", samples)
    assert all(c >= 0 for c in model.coefficients.values())
    assert model.predict(BatchSummary.of([BatchEntry("a", 10_000, 100)])) > 0
