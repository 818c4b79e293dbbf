"""Merged mode: a run of steps on one adapter folds it into the base weights (once the switch has paid); anything else
restores them bit for bit; outputs stay equal to transformers + PEFT throughout, in mixture mode too
(other adapters' and base-model tokens beside the merged adapter's)."""

from __future__ import annotations

import itertools

import torch
from prometheus_client import REGISTRY

from gpu_worker.engine import StepRecord
from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.merge_switch import MergeSwitch
from gpu_worker.metrics import StepMetrics
from gpu_worker.orchestrator import UNMERGED, InferenceMode, StepPlan
from gpu_worker.sequence import SamplingParams
from services.common.config import WorkerConfig
from services.demo_assets import DEMO_BASE_MODEL
from tests.reference import ReferenceModels, assert_same_greedy

from .conftest import run_all, run_together, tokens_of

PROMPT = "import os\nimport sys\n"
MAX_NEW = 12


def _weights(engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine._runner.model.named_parameters()}


def test_one_adapter_runs_merged_then_base_weights_come_back_exactly(engine_factory, tiny_assets):
    steps = []
    engine = engine_factory(steps=steps)
    before = _weights(engine)
    adapter = tiny_assets.adapters["demo-r64"]  # targets all seven projections
    requests = [GenerationRequest(f"m{i}", PROMPT, SamplingParams(max_tokens=MAX_NEW), adapter) for i in range(3)]
    merged_outputs = run_all(engine, requests)
    # The first steps run unmerged until what merging would save has paid for the switch; from then on merged.
    merged_from = next(i for i, s in enumerate(steps) if s.merged_adapter)
    assert merged_from >= 1 and all(s.merged_adapter == "demo-r64" and s.mode == "merged" for s in steps[merged_from:])
    assert any(not torch.equal(p, before[n]) for n, p in engine._runner.model.named_parameters())

    # A base request needs the base weights: restored exactly, and the step runs unmerged.
    (base_outputs,) = run_all(engine, [GenerationRequest("base", PROMPT, SamplingParams(max_tokens=2))])
    assert steps[-1].merged_adapter is None
    for name, param in engine._runner.model.named_parameters():
        assert torch.equal(param, before[name]), name

    models = ReferenceModels(DEMO_BASE_MODEL, tiny_assets.base_dir, {"demo-r64": adapter.storage_path})
    expected = models.greedy_text("demo-r64", PROMPT, MAX_NEW)
    for outputs in merged_outputs:
        assert_same_greedy("merged demo-r64", expected, tokens_of(outputs))
    assert_same_greedy("base after unmerge", models.greedy_text(DEMO_BASE_MODEL, PROMPT, 2), tokens_of(base_outputs))


def test_switching_adapters_never_drifts_the_base_weights(engine_factory, tiny_assets):
    """Merge r8, then r16 (unmerging r8 first), with one adapter slot reused: the weights the engine
    returns to are the original ones, bit for bit. Merge-only, so that every run merges whatever the
    credit policy's measured switch cost on a loaded machine would say."""
    steps = []
    engine = engine_factory(steps=steps, adapter_slots=1, mode_policy="merged")
    before = _weights(engine)
    for round_ in range(2):
        for name in ("demo-r8", "demo-r16"):
            run_all(engine, [GenerationRequest(f"{name}-{round_}", PROMPT, SamplingParams(max_tokens=3),
                                               tiny_assets.adapters[name])])
    assert {s.merged_adapter for s in steps} >= {"demo-r8", "demo-r16"}
    run_all(engine, [GenerationRequest("base", PROMPT, SamplingParams(max_tokens=1))])
    for name, param in engine._runner.model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_the_backups_of_the_base_weights_are_reserved_before_the_kv_cache(engine_factory):
    """Every adapted projection's backup is held from the start (before the KV cache is sized on what
    is left), not allocated at the first merge."""
    engine = engine_factory()
    switch, modules = engine._runner.merge_switch, engine._runner.model.lora_layers(WorkerConfig().lora_targets)
    weights = {id(module): module.weight for module, _ in modules.values()}
    assert switch.available and switch.reserved_bytes == sum(w.numel() * w.element_size() for w in weights.values())


def test_a_switch_without_room_for_its_backups_is_off_from_the_start(engine_factory, monkeypatch):
    engine = engine_factory()
    modules = list({id(m): m for m, _ in engine._runner.model.lora_layers(WorkerConfig().lora_targets).values()}.values())

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("no room")
    monkeypatch.setattr(torch, "empty_like", no_memory)
    switch = MergeSwitch(modules)
    assert not switch.available and switch.reserved_bytes == 0


def test_steps_their_time_and_switches_are_counted_by_mode():
    """U, M(a), M(a), U, M(b): 3 merged and 2 unmerged steps, 3 switches (merge a, restore, merge b)."""
    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0
    names = [("tessera_worker_mode_steps_total", {"mode": "merged"}),
             ("tessera_worker_mode_steps_total", {"mode": "unmerged"}),
             ("tessera_worker_mode_seconds_total", {"mode": "merged"}), ("tessera_worker_mode_switches_total", {})]
    before = [value(name, **labels) for name, labels in names]
    record = StepMetrics()
    for step, merged in enumerate([None, "a", "a", None, "b"]):
        record(StepRecord(step, ("r",), (merged or "x",), 0, 1, 0, 0.5, merged, "merged" if merged else "unmerged"))
    after = [value(name, **labels) for name, labels in names]
    assert [b - a for a, b in zip(before, after)] == [3, 2, 1.5, 3]


def test_mixture_mode_gives_peft_outputs_for_every_adapter_and_the_base_model(engine_factory, tiny_assets):
    """demo-r64 folded into the weights while demo-r16, demo-r8 and base-model requests share its steps
    (each adding its own delta and demo-r64's negated), switching between mixture and unmerged steps
    mid-prefill and mid-decode; then a step without demo-r64 restores the base weights bit for bit. The
    requests arrive together on resident adapters (`run_together`), so the steps are the same every run."""
    steps = []
    engine = engine_factory(steps=steps, start=False, max_batch_tokens=24)
    before = _weights(engine)
    calls = itertools.count()

    def plan(batch):
        slots = {item.seq.adapter.name: item.seq.slot for item in batch.items if item.seq.adapter}
        if "demo-r64" in slots and next(calls) % 3:  # two steps in three mixture, the third unmerged
            return StepPlan(InferenceMode.MIXTURE, "demo-r64", slots["demo-r64"])
        return UNMERGED
    engine._orchestrator.plan = plan
    prompts = {"demo-r64": PROMPT * 3, "demo-r16": "def f(x):\n", "demo-r8": PROMPT, None: "for i in range(3):\n"}
    requests = [GenerationRequest(f"x{i}", prompt, SamplingParams(max_tokens=MAX_NEW),
                                  tiny_assets.adapters[name] if name else None)
                for i, (name, prompt) in enumerate(prompts.items())]
    outputs = run_together(engine, requests)
    assert {s.mode for s in steps} == {"mixture", "unmerged"}
    assert any(s.mode == "mixture" and s.num_prefills and len(set(s.adapters)) > 2 for s in steps)

    models = ReferenceModels(DEMO_BASE_MODEL, tiny_assets.base_dir,
                             {name: tiny_assets.adapters[name].storage_path for name in prompts if name})
    for (name, prompt), output in zip(prompts.items(), outputs):
        assert_same_greedy(f"{name} in mixture mode", models.greedy_text(name or DEMO_BASE_MODEL, prompt, MAX_NEW),
                           tokens_of(output))
    run_all(engine, [GenerationRequest("base", PROMPT, SamplingParams(max_tokens=1))])
    for name, param in engine._runner.model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_merge_only_pauses_the_other_adapters_requests_and_they_resume_with_peft_outputs(engine_factory, tiny_assets):
    """The mode policy shapes the batch: merge-only runs one adapter's requests at a time, merged, while the
    other adapter's running requests wait with their KV blocks until they starve (a 20 ms objective here),
    then takes their adapter. Every output still equals PEFT's, and a base request restores the weights."""
    steps = []
    engine = engine_factory(steps=steps, mode_policy="merged", default_tpot_slo_ms=20, default_ttft_slo_ms=20)
    before = _weights(engine)
    names = ("demo-r64", "demo-r16")
    prompts = (PROMPT, "def f(x):\n", "for i in range(3):\n", PROMPT * 2)
    requests = [GenerationRequest(f"p{i}", prompt, SamplingParams(max_tokens=MAX_NEW), tiny_assets.adapters[names[i % 2]])
                for i, prompt in enumerate(prompts)]
    outputs = run_all(engine, requests)
    merged = [s for s in steps if s.mode == "merged"]
    assert all(set(s.adapters) == {s.merged_adapter} for s in merged)  # nothing else ran beside it
    turns = [s.merged_adapter for s in merged]
    assert set(turns) == set(names) and sum(a != b for a, b in zip(turns, turns[1:])) >= 2, turns  # they took turns
    ran = {rid: [i for i, s in enumerate(steps) if rid in s.request_ids] for rid in ("p0", "p1")}
    assert any(b - a > 1 for rid in ran for a, b in zip(ran[rid], ran[rid][1:])), ran  # paused mid-generation

    models = ReferenceModels(DEMO_BASE_MODEL, tiny_assets.base_dir,
                             {name: tiny_assets.adapters[name].storage_path for name in names})
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        name = names[i % 2]
        assert_same_greedy(f"{name} under merge-only", models.greedy_text(name, prompt, MAX_NEW), tokens_of(output))
    run_all(engine, [GenerationRequest("base", PROMPT, SamplingParams(max_tokens=1))])
    for name, param in engine._runner.model.named_parameters():
        assert torch.equal(param, before[name]), name
