"""Qwen2-VL in the engine: greedy tokens for chat requests with one image, images of three sizes, three
frames, images in several turns and no image, under two adapters and the base model in shared batches,
equal transformers' Qwen2VLForConditionalGeneration (+ PEFT) `generate` on the same input ids, pixel
values and image grids; also with chunked prefill splitting image tokens (and their 3-D positions)
across steps, with preemption, and through the image and KV prefix caches. The prompt, built without
Qwen2VLProcessor (it needs torchvision), equals that processor's; adapters on the vision tower are refused."""

from __future__ import annotations

import functools
import json
from unittest import mock

import pytest
import torch

from gpu_worker.intake import GenerationRequest
from gpu_worker.models.families import load_served_model
from gpu_worker.models.qwen2vl import Qwen2VLImageEncoder
from gpu_worker.prompts import ChatMessage, ImagePart, Prompt, PromptEncoder
from gpu_worker.sequence import SamplingParams, Sequence
from gpu_worker.vision.qwen2vl_processor import Qwen2VLPromptProcessor
from services.common.architectures import IMAGE_ARCHITECTURES
from services.common.errors import InvalidArgument
from tests.images import gradient_image
from tests.reference import VisionReferenceModels, assert_same_greedy

from .conftest import idle_stats, run_all, tokens_of
from .test_vision_llava import _processor_messages

MAX_NEW = 10
PNG, JPEG, WEBP = (gradient_image(1, (48, 40), "PNG"), gradient_image(2, (64, 32), "JPEG"),
                   gradient_image(3, (20, 47), "WEBP"))
FRAMES = tuple(gradient_image(10 + i, (40, 40), "PNG") for i in range(3))
PROMPTS: dict[str, Prompt] = {
    "one_image": (ChatMessage("user", ("What is in this picture? ", ImagePart(PNG))),),
    "other_image": (ChatMessage("user", ("What is in this picture? ", ImagePart(JPEG))),),
    "three_sizes": (ChatMessage("user", (ImagePart(PNG), " or ", ImagePart(JPEG), " or ", ImagePart(WEBP),
                                         ": which one is brighter?")),),
    "frames": (ChatMessage("user", ("Three frames of a video:", *map(ImagePart, FRAMES), " What happens?")),),
    "turns": (ChatMessage("user", ("Look: ", ImagePart(WEBP))), ChatMessage("assistant", "A gradient."),
              ChatMessage("user", ("And this one? ", ImagePart(PNG)))),
    "text": (ChatMessage("user", "def handle(self, request):\n    return"),),
}
CASES = (("demo-qwen2vl-r8", "one_image"), (None, "three_sizes"), (None, "text"), ("demo-qwen2vl-r16", "other_image"),
         ("demo-qwen2vl-r16", "frames"), ("demo-qwen2vl-r8", "turns"))
IMAGE_REQUESTS = sum(key != "text" for _, key in CASES)


@pytest.fixture(scope="module")
def processor(qwen2vl_assets) -> Qwen2VLPromptProcessor:
    return Qwen2VLPromptProcessor.from_pretrained(qwen2vl_assets.base_dir)


@pytest.fixture(scope="module")
def reference(qwen2vl_assets, processor):
    """(adapter, prompt key) -> transformers + PEFT greedy tokens and log-probabilities, computed once, on
    the input ids, pixel values, image grids (and image-token mask) of the processor stand-in."""
    models = VisionReferenceModels(qwen2vl_assets.name, qwen2vl_assets.base_dir,
                                   {name: ref.storage_path for name, ref in qwen2vl_assets.adapters.items()},
                                   processor=processor)

    @functools.cache
    def greedy(adapter: str | None, key: str):
        return models.greedy_messages(adapter or qwen2vl_assets.name, _processor_messages(PROMPTS[key]), MAX_NEW)
    return greedy


@pytest.fixture
def encoder_calls(monkeypatch) -> list[int]:
    """Counts Qwen2VLImageEncoder forward passes: each entry is how many images one pass encoded."""
    calls: list[int] = []
    forward = Qwen2VLImageEncoder.forward

    def counted(self, pixel_values, grid_thw):
        calls.append(grid_thw.shape[0])
        return forward(self, pixel_values, grid_thw)
    monkeypatch.setattr(Qwen2VLImageEncoder, "forward", counted)
    return calls


def _requests(assets, cases, tag: str) -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}-{i}", PROMPTS[key], SamplingParams(max_tokens=MAX_NEW),
                              assets.adapters[adapter] if adapter else None)
            for i, (adapter, key) in enumerate(cases)]


def _assert_match(reference, cases, results) -> None:
    for (adapter, key), outputs in zip(cases, results):
        assert_same_greedy(f"{adapter}: {key}", reference(adapter, key), tokens_of(outputs))


def _transformers_processor(processor: Qwen2VLPromptProcessor):
    """transformers' Qwen2VLProcessor over the same parts, built without the video processor it insists
    on (whose class check needs torchvision); images never reach that processor."""
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    check = Qwen2VLProcessor.check_argument_for_proper_class
    with mock.patch.object(Qwen2VLProcessor, "check_argument_for_proper_class",
                           lambda self, name, arg: None if arg is None else check(self, name, arg)):
        return Qwen2VLProcessor(image_processor=processor.image_processor, tokenizer=processor.tokenizer,
                                video_processor=None, chat_template=processor.tokenizer.chat_template)


def test_prompts_equal_qwen2vl_processor(processor):
    """Each image's <|image_pad|> expanded to t*h*w / merge^2 tokens, pixel values and grids: as the processor."""
    theirs = _transformers_processor(processor)
    for key, prompt in PROMPTS.items():
        messages = _processor_messages(prompt)
        want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                          return_tensors="pt")
        got = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                            return_tensors="pt")
        assert sorted(got) == sorted(want), key
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=f"{key}: {name}")


def test_prompt_images_carry_sizes_grids_and_positions(qwen2vl_assets, processor):
    """Images of three sizes: each its own token count and grid; the M-RoPE positions' delta is negative
    (an image of h x w merged patches advances positions by max(h, w), not by its h * w tokens)."""
    encoder = PromptEncoder(processor.tokenizer, 256, processor)
    images = encoder.encode(PROMPTS["three_sizes"], MAX_NEW).images
    assert images.grids == ((1, 4, 6), (1, 4, 8), (1, 6, 2))
    assert images.image_tokens == (6, 8, 3) and len(images.token_runs) == 3
    assert images.positions.delta == (3 - 6) + (4 - 8) + (3 - 3)


def test_images_adapters_and_positions_change_the_reference_output(qwen2vl_engine_factory, qwen2vl_assets,
                                                                   reference, monkeypatch):
    """Guards the tests' power: the image and each adapter change the greedy tokens, and so does rotating
    the prompt by plain 1-D positions instead of M-RoPE's."""
    assert reference(None, "one_image").tokens != reference(None, "other_image").tokens
    for adapter in ("demo-qwen2vl-r8", "demo-qwen2vl-r16"):
        assert reference(adapter, "one_image").tokens != reference(None, "one_image").tokens
    monkeypatch.setattr(Sequence, "rope_positions", lambda self, start, end: list(range(start, end)))
    cases = ((None, "three_sizes"), (None, "frames"))
    results = run_all(qwen2vl_engine_factory(), _requests(qwen2vl_assets, cases, "plain"))
    assert any(tokens_of(out) != reference(*case).tokens for case, out in zip(cases, results))


def test_mixed_batch_matches_transformers_and_peft(qwen2vl_engine_factory, qwen2vl_assets, reference, encoder_calls):
    steps = []
    engine = qwen2vl_engine_factory(steps=steps, image_cache_bytes=0)
    results = run_all(engine, _requests(qwen2vl_assets, CASES, "mixed"))
    _assert_match(reference, CASES, results)
    # One forward pass held every request, with image prompts, the text prompt, both adapters and the
    # base model; a step's new images (of different sizes) went through the vision tower in one pass.
    assert any(len(step.request_ids) == len(CASES)
               and set(step.adapters) == {None, "demo-qwen2vl-r8", "demo-qwen2vl-r16"} for step in steps), steps[:2]
    assert len(encoder_calls) <= 5  # a step's new images in one pass (test_vision_tower_lora.py counts them)


def test_chunked_prefill_splits_image_tokens_and_matches(qwen2vl_engine_factory, qwen2vl_assets, reference,
                                                         encoder_calls):
    """A 4-token budget cuts images of 6, 8 and 9 tokens across steps: each chunk takes its slice of the
    features and of the prompt's 3-D positions; the features are computed once per prompt."""
    steps = []
    engine = qwen2vl_engine_factory(steps=steps, max_batch_tokens=4, image_cache_bytes=0)
    results = run_all(engine, _requests(qwen2vl_assets, CASES, "chunked"))
    _assert_match(reference, CASES, results)
    assert all(step.num_tokens <= 4 for step in steps)
    assert len(encoder_calls) == IMAGE_REQUESTS


def test_preemption_recomputes_images_and_matches(qwen2vl_engine_factory, qwen2vl_assets, reference,
                                                  encoder_calls):
    """A KV pool of 10 blocks of 8 tokens cannot hold the batch: preempted sequences are recomputed
    (prompt and outputs: the outputs' positions continue after the prompt's largest), their images encoded
    again, and the tokens still match."""
    steps = []
    engine = qwen2vl_engine_factory(steps=steps, kv_cache_tokens=80, kv_block_size=8, image_cache_bytes=0,
                                    enable_prefix_caching=False)
    # The adapters resident first: which sequences get preempted depends on when each is admitted.
    run_all(engine, [GenerationRequest(f"warm-{name}", "warm", SamplingParams(max_tokens=1), ref)
                     for name, ref in qwen2vl_assets.adapters.items()])
    steps.clear()
    results = run_all(engine, _requests(qwen2vl_assets, CASES, "preempted"))
    _assert_match(reference, CASES, results)
    assert sum(step.num_preempted for step in steps) > 0
    assert len(encoder_calls) > IMAGE_REQUESTS


def test_image_and_prefix_caches_reuse_only_the_same_image(qwen2vl_engine_factory, qwen2vl_assets, reference,
                                                           encoder_calls):
    """One by one: a repeated prompt takes its image's features from the image cache and its leading KV
    blocks from the prefix cache; a prompt with the same text but another image shares only the blocks
    before that image. Tokens equal transformers + PEFT's every time."""
    engine = qwen2vl_engine_factory(kv_block_size=8)
    cases = [("demo-qwen2vl-r8", "one_image"), ("demo-qwen2vl-r8", "one_image"), ("demo-qwen2vl-r8", "other_image")]
    hits = []
    for i, case in enumerate(cases):
        before = idle_stats(engine).prefix_cache_hit_tokens_total
        (outputs,) = run_all(engine, _requests(qwen2vl_assets, [case], f"cached-{i}"))
        assert_same_greedy(f"cached {i}", reference(*case), tokens_of(outputs))
        hits.append(idle_stats(engine).prefix_cache_hit_tokens_total - before)
    assert encoder_calls == [1, 1]  # the repeated image was not encoded again
    first_image = PromptEncoder(*_encoder_parts(qwen2vl_assets)).encode(PROMPTS["one_image"], MAX_NEW)
    image_start = first_image.images.token_runs[0][0]
    assert hits[0] == 0 and hits[1] >= len(first_image.token_ids) - 8
    assert 0 < hits[2] <= image_start  # the text before the image, never the other image's blocks


def _encoder_parts(assets):
    processor = Qwen2VLPromptProcessor.from_pretrained(assets.base_dir)
    return processor.tokenizer, 256, processor





def test_placeholder_in_the_text_is_an_invalid_argument(qwen2vl_engine_factory):
    request = GenerationRequest("bad", (ChatMessage("user", ("<|image_pad|> is mine: ", ImagePart(PNG))),),
                                SamplingParams(max_tokens=2))
    with pytest.raises(InvalidArgument, match="images do not fit its text"):
        run_all(qwen2vl_engine_factory(), [request])


def test_image_architectures_load_with_an_image_encoder(llava_assets, qwen2vl_assets):
    """services/common/architectures.py's IMAGE_ARCHITECTURES (what the gateway sends images to) are what the
    worker loads with an image encoder and a processor."""
    loaded = {}
    for assets in (llava_assets, qwen2vl_assets):
        served = load_served_model(assets.base_dir, device=torch.device("cpu"), dtype=torch.float32)
        architecture = json.loads((assets.base_dir / "config.json").read_text())["architectures"][0]
        loaded[architecture] = served.image_encoder is not None and served.processor is not None
    assert loaded == dict.fromkeys(IMAGE_ARCHITECTURES, True)
