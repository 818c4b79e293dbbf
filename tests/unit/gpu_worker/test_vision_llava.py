"""LLaVA-1.5 in the engine: greedy tokens for chat requests with one image, two images, three frames,
images in several turns and no image, under two adapters and the base model in shared batches, equal
transformers' LlavaForConditionalGeneration (+ PEFT) `generate` on the same checkpoint, processor,
adapters and image bytes; also with chunked prefill splitting image tokens across steps and with
preemption. Adapters on the vision tower: test_vision_tower_lora.py; bad images are clear 4xx errors."""

from __future__ import annotations

import functools
import io

import pytest
from PIL import Image

from gpu_worker.intake import GenerationRequest
from gpu_worker.prompts import ChatMessage, ImagePart, Prompt
from gpu_worker.sequence import SamplingParams
from services.common.errors import InvalidArgument
from tests.images import gradient_image
from tests.reference import VisionReferenceModels, assert_same_greedy

from .conftest import TINY_CLIP, run_all, tokens_of

MAX_NEW = 12


PNG, JPEG, WEBP = (gradient_image(1, (48, 40), "PNG"), gradient_image(2, (64, 32), "JPEG"),
                   gradient_image(3, (33, 47), "WEBP"))
FRAMES = tuple(gradient_image(10 + i, (40, 40), "PNG") for i in range(3))
PROMPTS: dict[str, Prompt] = {
    "one_image": (ChatMessage("user", ("What is in this picture? ", ImagePart(PNG))),),
    "other_image": (ChatMessage("user", ("What is in this picture? ", ImagePart(JPEG))),),
    "two_images": (ChatMessage("user", (ImagePart(PNG), " or ", ImagePart(JPEG), ": which one is brighter?")),),
    "frames": (ChatMessage("user", ("Three frames of a video:", *map(ImagePart, FRAMES), " What happens?")),),
    "turns": (ChatMessage("user", ("Look: ", ImagePart(WEBP))), ChatMessage("assistant", "A gradient."),
              ChatMessage("user", ("And this one? ", ImagePart(PNG)))),
    "text": (ChatMessage("user", "def handle(self, request):\n    return"),),
}
CASES = (("demo-llava-r8", "one_image"), (None, "two_images"), (None, "text"), ("demo-llava-r16", "other_image"),
         ("demo-llava-r16", "frames"), ("demo-llava-r8", "turns"))
IMAGE_REQUESTS = sum(key != "text" for _, key in CASES)


def _processor_messages(prompt: Prompt) -> list[dict]:
    """Our chat prompt in the processor's message form, each image decoded from the same bytes."""
    def part(p: str | ImagePart) -> dict:
        if isinstance(p, ImagePart):
            return {"type": "image", "image": Image.open(io.BytesIO(p.data))}
        return {"type": "text", "text": p}
    return [{"role": m.role, "content": [part(p) for p in ((m.content,) if isinstance(m.content, str) else m.content)]}
            for m in prompt]


@pytest.fixture(scope="module")
def reference(llava_assets):
    """(adapter, prompt key) -> transformers + PEFT greedy tokens and log-probabilities, computed once."""
    models = VisionReferenceModels(llava_assets.name, llava_assets.base_dir,
                                   {name: ref.storage_path for name, ref in llava_assets.adapters.items()})

    @functools.cache
    def greedy(adapter: str | None, key: str):
        return models.greedy_messages(adapter or llava_assets.name, _processor_messages(PROMPTS[key]), MAX_NEW)
    return greedy


def _requests(llava_assets, cases, tag: str) -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}-{i}", PROMPTS[key], SamplingParams(max_tokens=MAX_NEW),
                              llava_assets.adapters[adapter] if adapter else None)
            for i, (adapter, key) in enumerate(cases)]


def _assert_match(reference, cases, results) -> None:
    for (adapter, key), outputs in zip(cases, results):
        assert_same_greedy(f"{adapter}: {key}", reference(adapter, key), tokens_of(outputs))


def test_images_and_adapters_change_the_reference_output(reference):
    """Guards the tests' power: the image, and each adapter, change the greedy tokens."""
    assert reference(None, "one_image").tokens != reference(None, "other_image").tokens
    for adapter in ("demo-llava-r8", "demo-llava-r16"):
        assert reference(adapter, "one_image").tokens != reference(None, "one_image").tokens


def test_mixed_batch_matches_transformers_and_peft(llava_engine_factory, llava_assets, reference, encoder_calls):
    steps = []
    engine = llava_engine_factory(steps=steps, image_cache_bytes=0)  # test_vision_cache.py covers the cache
    results = run_all(engine, _requests(llava_assets, CASES, "mixed"))
    _assert_match(reference, CASES, results)
    # One forward pass held every request, with image prompts, the text prompt, both adapters and
    # the base model; a step's new images went through the vision tower in one pass, each distinct image once
    # (PNG, JPEG, WEBP and three frames; test_vision_tower_lora.py counts the passes of one step).
    assert any(len(step.request_ids) == len(CASES) and set(step.adapters) == {None, "demo-llava-r8", "demo-llava-r16"}
               for step in steps), steps[:2]
    assert sum(encoder_calls) <= 9 and len(encoder_calls) <= IMAGE_REQUESTS


def test_chunked_prefill_splits_image_tokens_and_matches(llava_engine_factory, llava_assets, reference,
                                                         encoder_calls):
    """A 7-token budget cuts every image's 16 tokens across steps: each chunk takes its slice of the
    features, which are computed once per prompt, not once per chunk."""
    steps = []
    engine = llava_engine_factory(steps=steps, max_batch_tokens=7, image_cache_bytes=0)
    assert 7 < (TINY_CLIP.image_size // TINY_CLIP.patch_size) ** 2
    results = run_all(engine, _requests(llava_assets, CASES, "chunked"))
    _assert_match(reference, CASES, results)
    assert all(step.num_tokens <= 7 for step in steps)
    assert len(encoder_calls) == IMAGE_REQUESTS


def test_preemption_recomputes_images_and_matches(llava_engine_factory, llava_assets, reference, encoder_calls):
    """A KV pool of 12 blocks of 8 tokens cannot hold the batch (the frames prompt alone needs 11):
    preempted sequences are recomputed, their images encoded again where their features had been
    dropped, and the tokens still match."""
    steps = []
    # Both caches off: with them, a recompute reuses the features or the KV instead of re-encoding.
    engine = llava_engine_factory(steps=steps, kv_cache_tokens=96, kv_block_size=8, image_cache_bytes=0,
                                  enable_prefix_caching=False)
    # The adapters resident first: which sequences get preempted depends on when each is admitted.
    run_all(engine, [GenerationRequest(f"warm-{name}", "warm", SamplingParams(max_tokens=1), ref)
                     for name, ref in llava_assets.adapters.items()])
    steps.clear()
    results = run_all(engine, _requests(llava_assets, CASES, "preempted"))
    _assert_match(reference, CASES, results)
    assert sum(step.num_preempted for step in steps) > 0
    assert len(encoder_calls) > IMAGE_REQUESTS


@pytest.mark.parametrize("content, message", [
    (("Look: ", ImagePart(b"\x89PNG\r\n\x1a\n not really")), "image 0 is not a decodable image"),
    (("<image> is mine: ", ImagePart(PNG)), "images do not fit its text"),
])
def test_bad_images_are_invalid_arguments(llava_engine_factory, content, message):
    engine = llava_engine_factory()
    request = GenerationRequest("bad", (ChatMessage("user", content),), SamplingParams(max_tokens=2))
    with pytest.raises(InvalidArgument, match=message):
        run_all(engine, [request])


def test_text_model_refuses_images(engine_factory):
    engine = engine_factory()
    request = GenerationRequest("image-to-text-model", PROMPTS["one_image"], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidArgument, match="does not take images"):
        run_all(engine, [request])
