"""Task-head requests on the engine: answers equal transformers + PEFT (a SEQ_CLS adapter) and a plain-torch
reference (VaLoRA's MLP and detection heads), batched with generating requests and with each other, in
merged mode, over chunked prompts and prefix-cache hits; and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.sequence import SamplingParams
from services.common.adapter_layout import CONFIG_FILE, WEIGHTS_FILE, directory_digest
from services.common.errors import InvalidArgument
from services.common.task_heads import parse_task_head
from services.demo_assets import DEMO_BASE_MODEL, DemoAdapterSpec, build_lora_adapter
from services.demo_heads import DemoHead
from tests.reference import (ReferenceModels, assert_same_greedy, detection_head_boxes, head_tensors, mlp_head_probs,
                             peft_classifier_probs)

from .conftest import TINY_LLAMA, run_all, run_together, tokens_of

CLASSIFIER = DemoAdapterSpec("head-classifier", 8, 16.0, ("q_proj", "v_proj"), 21,
                             head=DemoHead("classifier", ("no", "maybe", "yes")))
MLP = DemoAdapterSpec("head-mlp", 4, 8.0, ("q_proj", "k_proj", "v_proj", "o_proj"), 22,
                      head=DemoHead("mlp", ("walk", "run", "jump", "sit", "wave"), inner=48))
DETECTION = DemoAdapterSpec("head-detection", 8, 16.0, ("v_proj", "down_proj"), 23,
                            head=DemoHead("detection", ("cat", "dog"), num_queries=3, inner=32))
PROMPTS = ("def main():\n    return 1\n", "import os\n", "class Point:\n    x: int\n    y: int\n" * 3)
TOLERANCE = 1e-5


def _head_ref(tiny_assets, spec: DemoAdapterSpec) -> AdapterRef:
    """Built into the worker's store and recorded as the registry records it, head derived from the files."""
    directory = build_lora_adapter(tiny_assets.base_dir, tiny_assets.store / spec.name, spec)
    config = json.loads((directory / CONFIG_FILE).read_text())
    with safe_open(directory / WEIGHTS_FILE, "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    head = parse_task_head(config, shapes, TINY_LLAMA.hidden_size)
    return AdapterRef(spec.name, DEMO_BASE_MODEL, spec.rank, directory_digest(directory), str(directory), head=head)


@pytest.fixture(scope="module")
def heads(tiny_assets) -> dict[str, AdapterRef]:
    return {spec.name: _head_ref(tiny_assets, spec) for spec in (CLASSIFIER, MLP, DETECTION)}


def _ask(name: str, prompt: str, ref: AdapterRef) -> GenerationRequest:
    return GenerationRequest(name, prompt, SamplingParams(), ref, task_head=True)


def _peft_probs(base_dir: Path, ref: AdapterRef, prompt: str) -> torch.Tensor:
    return peft_classifier_probs(base_dir, Path(ref.storage_path), len(ref.head.labels), prompt)


def _hidden(base_dir: Path, ref: AdapterRef, prompt: str) -> torch.Tensor:
    reference = ReferenceModels(DEMO_BASE_MODEL, base_dir, {ref.name: ref.storage_path})
    return reference.final_hidden(ref.name, reference.tokenizer(prompt, return_tensors="pt"))


def _mlp_reference(base_dir: Path, ref: AdapterRef, prompt: str) -> torch.Tensor:
    return mlp_head_probs(head_tensors(Path(ref.storage_path)), ref.head, _hidden(base_dir, ref, prompt))


def _detection_reference(base_dir: Path, ref: AdapterRef, prompt: str) -> list[tuple[str, float, list[float]]]:
    return detection_head_boxes(head_tensors(Path(ref.storage_path)), ref.head, _hidden(base_dir, ref, prompt))


def _answer(outputs):
    (only,) = outputs
    assert only.head is not None and only.token_ids == [] and only.completion_tokens == 0
    return only.head


def _assert_detections(answer, expected) -> None:
    assert [d.label for d in answer.detections] == [label for label, _, _ in expected]
    for found, (_, score, box) in zip(answer.detections, expected):
        assert found.score == pytest.approx(score, abs=TOLERANCE)
        assert list(found.box) == pytest.approx(box, abs=TOLERANCE)


def test_heads_answer_as_peft_and_the_references_beside_generation(engine_factory, tiny_assets, heads):
    """Heads of three kinds and label counts, and a generating request of a plain adapter, in shared steps."""
    base_dir, steps = tiny_assets.base_dir, []
    classifier, mlp, detection = heads.values()
    plain = tiny_assets.adapters["demo-r16"]
    requests = [_ask(f"c{i}", p, classifier) for i, p in enumerate(PROMPTS)]
    requests += [_ask("m0", PROMPTS[0], mlp), _ask("d0", PROMPTS[2], detection),
                 GenerationRequest("g0", PROMPTS[1], SamplingParams(max_tokens=6), plain)]
    results = run_together(engine_factory(steps=steps, start=False), requests)

    for prompt, outputs in zip(PROMPTS, results[:3]):
        answer = _answer(outputs)
        expected = _peft_probs(base_dir, classifier, prompt)
        assert torch.allclose(torch.tensor(answer.probs), expected, atol=TOLERANCE), (answer.probs, expected)
        assert answer.label == classifier.head.labels[int(expected.argmax())]
    assert len({_answer(r).label for r in results[:3]}) > 1 or len(set(_answer(r).probs for r in results[:3])) == 3

    mlp_expected = _mlp_reference(base_dir, mlp, PROMPTS[0])
    assert torch.allclose(torch.tensor(_answer(results[3]).probs), mlp_expected, atol=TOLERANCE)
    detections = _detection_reference(base_dir, detection, PROMPTS[2])
    assert detections, "the test's power: the reference finds boxes"
    _assert_detections(_answer(results[4]), detections)

    reference = ReferenceModels(DEMO_BASE_MODEL, base_dir, {plain.name: plain.storage_path})
    assert_same_greedy(plain.name, reference.greedy_text(plain.name, PROMPTS[1], 6), tokens_of(results[5]))
    first = next(s for s in steps if "g0" in s.request_ids)
    assert {"c0", "m0", "d0"} <= set(first.request_ids), first  # one step ran every kind beside generation


def test_merged_mode_chunked_prompts_and_prefix_hits_answer_the_same(engine_factory, tiny_assets, heads):
    classifier, detection = heads["head-classifier"], heads["head-detection"]
    long_prompt = PROMPTS[2] * 4
    steps = []
    # Chunks of 16 tokens: the detection head's 3 positions may straddle two chunks; block size 16 leaves
    # the prompt's tail for the head after a prefix-cache hit.
    engine = engine_factory(steps=steps, max_batch_tokens=16, kv_block_size=16)
    first = run_all(engine, [_ask("d1", long_prompt, detection)] + [_ask(f"c{i}", long_prompt, classifier)
                                                                      for i in range(3)])
    again = run_all(engine, [_ask("d2", long_prompt, detection), _ask("c9", long_prompt, classifier)])
    assert engine.stats().prefix_cache_hit_tokens_total > 0

    expected = _peft_probs(tiny_assets.base_dir, classifier, long_prompt)
    for outputs in first[1:] + again[1:]:
        assert torch.allclose(torch.tensor(_answer(outputs).probs), expected, atol=TOLERANCE)
    detections = _detection_reference(tiny_assets.base_dir, detection, long_prompt)
    for outputs in (first[0], again[0]):
        _assert_detections(_answer(outputs), detections)


def test_merged_steps_answer_as_peft(engine_factory, tiny_assets, heads):
    classifier = heads["head-classifier"]
    steps = []
    engine = engine_factory(steps=steps, start=False, mode_policy="merged")
    results = run_together(engine, [_ask(f"c{i}", PROMPTS[i % 3], classifier) for i in range(6)])
    assert any(s.merged_adapter == classifier.name for s in steps)
    for i, outputs in enumerate(results):
        expected = _peft_probs(tiny_assets.base_dir, classifier, PROMPTS[i % 3])
        assert torch.allclose(torch.tensor(_answer(outputs).probs), expected, atol=TOLERANCE)


@pytest.mark.parametrize("case", ["head adapter generates", "plain adapter classifies", "base model classifies",
                                  "prompt shorter than the queries"])
def test_refusals(engine_factory, tiny_assets, heads, case):
    engine = engine_factory()
    request = {
        "head adapter generates": GenerationRequest("x", PROMPTS[0], SamplingParams(), heads["head-mlp"]),
        "plain adapter classifies": _ask("x", PROMPTS[0], tiny_assets.adapters["demo-r8"]),
        "base model classifies": GenerationRequest("x", PROMPTS[0], SamplingParams(), None, task_head=True),
        "prompt shorter than the queries": _ask("x", "a", heads["head-detection"]),
    }[case]
    with pytest.raises(InvalidArgument) as raised:
        run_all(engine, [request])
    assert ("task head" in raised.value.message) or ("last 3 tokens" in raised.value.message)
    # Nothing else disturbed: the engine serves the next request.
    assert _answer(run_all(engine, [_ask("ok", PROMPTS[0], heads["head-classifier"])])[0]).label
