"""LoRA on the vision tower and projector, served: PEFT adapters saved with bare target names (LLaVA's
q_proj / v_proj adapt CLIP as well as the language model; one also adapts the projector; Qwen2-VL's qkv
its ViT) give transformers + PEFT's greedy tokens; a batch of two tower adapters, a language-model
adapter and the base model, with images, equals each reference and encodes the step's images in ONE
encoder pass; a name registered again with new weights serves the new features, not cached old ones."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForImageTextToText

from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.sequence import SamplingParams
from gpu_worker.vision.qwen2vl_processor import Qwen2VLPromptProcessor
from services.common.adapter_layout import directory_digest
from services.demo_assets import LORA_B_GAIN
from tests.reference import VisionReferenceModels, assert_same_greedy

from . import test_vision_llava as llava
from . import test_vision_qwen2vl as qwen2vl
from .conftest import run_all, run_together, tokens_of

MAX_NEW = 8


def _tower_adapter(base_dir: Path, directory: Path, targets: list[str], seed: int) -> Path:
    """A PEFT adapter with bare `targets` and random A and B (B scaled as the demo adapters' are)."""
    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(LORA_B_GAIN)
    model.save_pretrained(directory)
    return directory


def _ref(name: str, base_name: str, directory: Path, tower_lora_params: int) -> AdapterRef:
    return AdapterRef(name, base_name, 4, directory_digest(directory), str(directory), tower_lora_params=tower_lora_params)


# CLIP hidden 32, 2 layers; projector 32 -> 64 -> 64 (tests/unit/gpu_worker/conftest.py's tiny shapes).
CLIP_QV = 2 * 2 * 4 * (32 + 32)
PROJECTOR = 4 * (32 + 64) + 4 * (64 + 64)


@pytest.fixture(scope="module")
def llava_tower(llava_assets) -> dict[str, AdapterRef]:
    store, base, name = llava_assets.store, llava_assets.base_dir, llava_assets.name
    return {
        "tower-qv": _ref("tower-qv", name, _tower_adapter(base, store / "tower-qv", ["q_proj", "v_proj"], 21), CLIP_QV),
        "tower-proj": _ref("tower-proj", name, _tower_adapter(base, store / "tower-proj",
                                                              ["q_proj", "v_proj", "linear_1", "linear_2"], 22),
                           CLIP_QV + PROJECTOR),
        **llava_assets.adapters}


@pytest.fixture(scope="module")
def llava_reference(llava_assets, llava_tower):
    models = VisionReferenceModels(llava_assets.name, llava_assets.base_dir,
                                   {name: ref.storage_path for name, ref in llava_tower.items()})

    @functools.cache
    def greedy(adapter: str | None, key: str):
        return models.greedy_messages(adapter or llava_assets.name, llava._processor_messages(llava.PROMPTS[key]),
                                      MAX_NEW)
    return greedy


def _requests(refs: dict[str, AdapterRef], cases, tag: str) -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}-{i}", prompts[key], SamplingParams(max_tokens=MAX_NEW),
                              refs[adapter] if adapter else None)
            for i, (adapter, key, prompts) in enumerate(cases)]


def test_tower_adapters_change_the_reference_output(llava_reference):
    """Guards the tests' power: the tower LoRA changes the greedy tokens."""
    assert llava_reference("tower-qv", "one_image").tokens != llava_reference(None, "one_image").tokens
    assert llava_reference("tower-proj", "one_image").tokens != llava_reference("tower-qv", "one_image").tokens


def test_mixed_tower_batch_is_one_encoder_pass_and_matches_peft(llava_engine_factory, llava_tower, llava_reference,
                                                                encoder_calls):
    """Two tower adapters, a language-model adapter and the base model in one step, with images: each equals
    transformers + PEFT, and the step encoded every image, of all four, in one pass."""
    cases = [("tower-qv", "one_image"), ("tower-proj", "two_images"), ("demo-llava-r8", "other_image"),
             (None, "one_image"), ("tower-qv", "turns")]
    steps = []
    engine = llava_engine_factory(steps=steps, image_cache_bytes=1 << 20, start=False)
    results = run_together(engine, _requests(llava_tower, [(a, k, llava.PROMPTS) for a, k in cases], "tower"))
    for (adapter, key), outputs in zip(cases, results):
        assert_same_greedy(f"{adapter}: {key}", llava_reference(adapter, key), tokens_of(outputs))
    assert len(steps[0].request_ids) == len(cases)
    # PNG x tower-qv (shared by two prompts), PNG and JPEG x tower-proj, JPEG and PNG x the base tower
    # (demo-llava-r8 has no tower LoRA: it shares the base features), WEBP x tower-qv: 6 images, one pass.
    assert encoder_calls == [6]


def test_replaced_adapter_serves_its_new_tower(llava_engine_factory, llava_assets, llava_tower, llava_reference):
    """Same name, new weights, new digest: the cached features of the old version are never served."""
    engine = llava_engine_factory(image_cache_bytes=1 << 20)
    old = llava_tower["tower-qv"]
    (first,) = run_all(engine, _requests({"tower": old}, [("tower", "one_image", llava.PROMPTS)], "old"))
    assert_same_greedy("old", llava_reference("tower-qv", "one_image"), tokens_of(first))
    # The new version's files are tower-proj's: its reference is tower-proj's.
    new = AdapterRef("tower-qv", old.base_model, 4, llava_tower["tower-proj"].sha256,
                     llava_tower["tower-proj"].storage_path, registered_ms=1, tower_lora_params=CLIP_QV + PROJECTOR)
    (second,) = run_all(engine, _requests({"tower": new}, [("tower", "one_image", llava.PROMPTS)], "new"))
    assert_same_greedy("new", llava_reference("tower-proj", "one_image"), tokens_of(second))


def test_tower_lora_params_must_be_the_registrys(llava_engine_factory, llava_tower):
    from services.common.errors import AdapterLoadFailed

    wrong = AdapterRef(**{**llava_tower["tower-qv"].__dict__, "tower_lora_params": 0})
    with pytest.raises(AdapterLoadFailed, match="LoRA parameters on the vision tower"):
        run_all(llava_engine_factory(), _requests({"t": wrong}, [("t", "one_image", llava.PROMPTS)], "wrong"))


def test_qwen2vl_tower_adapter_matches_peft(qwen2vl_engine_factory, qwen2vl_assets):
    """Qwen2-VL: bare "qkv" (the ViT), "mlp.0" (the merger), "q_proj" / "v_proj" (the language model), images of
    three sizes next to a base-model request: one encoder pass, rows of patches and merged patches per adapter."""
    directory = _tower_adapter(qwen2vl_assets.base_dir, qwen2vl_assets.store / "tower-qkv",
                               ["qkv", "mlp.0", "q_proj", "v_proj"], 23)
    ref = _ref("tower-qkv", qwen2vl_assets.name, directory, 2 * 4 * (32 + 96) + 4 * (128 + 128))
    processor = Qwen2VLPromptProcessor.from_pretrained(qwen2vl_assets.base_dir)
    models = VisionReferenceModels(qwen2vl_assets.name, qwen2vl_assets.base_dir, {"tower-qkv": directory},
                                   processor=qwen2vl._transformers_processor(processor))
    cases = [("tower-qkv", "three_sizes"), (None, "one_image"), ("tower-qkv", "one_image")]
    engine = qwen2vl_engine_factory(start=False)
    results = run_together(engine, _requests({"tower-qkv": ref}, [(a, k, qwen2vl.PROMPTS) for a, k in cases], "q"))
    expected = {case: models.greedy_messages(case[0] or qwen2vl_assets.name,
                                             qwen2vl._processor_messages(qwen2vl.PROMPTS[case[1]]), MAX_NEW)
                for case in cases}
    assert expected[cases[2]].tokens != expected[cases[1]].tokens
    for case, outputs in zip(cases, results):
        assert_same_greedy(str(case), expected[case], tokens_of(outputs))
