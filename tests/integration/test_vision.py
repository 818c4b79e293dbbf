"""Images through the real gateway: the system's workers for the vision demo models (tessera-demo-llava and
tessera-demo-qwen2vl, which `tessera up` starts beside the text model's); an image+text chat under one of
their adapters, over
REST (the openai client) and over gRPC, gives exactly the greedy text of transformers'
LlavaForConditionalGeneration / Qwen2VLForConditionalGeneration + PEFT on the same image, prompt and
adapter. A bad image, or an image for the text model, is a 400."""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
import requests
from PIL import Image

from benchmarks.harness.live_system import RunningSystem
from gpu_worker.vision.qwen2vl_processor import Qwen2VLPromptProcessor
from services.demo_assets import DEMO_QWEN2VL_BASE_MODEL, DEMO_VISION_BASE_MODEL
from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.images import data_url, gradient_image
from tests.reference import VisionReferenceModels, assert_same_greedy

pytestmark = pytest.mark.integration

MAX_TOKENS = 10
IMAGE = gradient_image(1, (48, 40), "PNG")
QUESTION, AFTER = "What is in this picture? ", " Answer briefly."
# Prompt name -> the images between QUESTION and AFTER: one image, two images, a 3-frame video.
PROMPT_IMAGES = {"one_image": [IMAGE], "two_images": [IMAGE, gradient_image(2, (40, 56), "PNG")],
                 "three_frames": [gradient_image(10 + i, (48, 40), "PNG") for i in range(3)]}


@dataclass(frozen=True)
class VisionModel:
    base_model: str
    adapter: str


MODELS = (VisionModel(DEMO_VISION_BASE_MODEL, "demo-llava-r8"), VisionModel(DEMO_QWEN2VL_BASE_MODEL, "demo-qwen2vl-r8"))


@pytest.fixture(scope="module", params=MODELS, ids=lambda model: model.base_model)
def vision_worker(system: RunningSystem, request: pytest.FixtureRequest) -> VisionModel:
    """The system's worker for a vision demo model, routable through its gateway."""
    model: VisionModel = request.param
    _wait_routable(system, model.base_model)
    return model


def _wait_routable(system: RunningSystem, base_model: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        last = requests.post(f"{system.http_base}/chat/completions", timeout=60, json={
            "model": base_model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1})
        if last.status_code == 200:
            return
        assert time.monotonic() < deadline, f"gateway cannot route to the vision worker: {last.text}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def expected_text(system: RunningSystem, vision_worker: VisionModel) -> tuple[VisionReferenceModels, dict]:
    """transformers + PEFT greedy tokens for the demo files (the registry stores byte-identical copies)."""
    models_dir = system.home / "models"
    base_dir: Path = models_dir / vision_worker.base_model
    # Qwen2VLProcessor cannot be built without torchvision: the worker's stand-in makes the same inputs.
    processor = Qwen2VLPromptProcessor.from_pretrained(base_dir) \
        if vision_worker.base_model == DEMO_QWEN2VL_BASE_MODEL else None
    reference = VisionReferenceModels(vision_worker.base_model, base_dir,
                                      {vision_worker.adapter: models_dir / "adapters" / vision_worker.adapter},
                                      processor=processor)
    expected = {}
    for name, images in PROMPT_IMAGES.items():
        parts = [{"type": "image", "image": Image.open(io.BytesIO(image))} for image in images]
        messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, *parts,
                                                 {"type": "text", "text": AFTER}]}]
        expected[name] = reference.greedy_messages(vision_worker.adapter, messages, MAX_TOKENS)
    return reference, expected


@pytest.mark.parametrize("prompt", sorted(PROMPT_IMAGES))
def test_rest_image_chat_equals_transformers_and_peft(system, vision_worker, expected_text, prompt) -> None:
    reference, expected_by_prompt = expected_text
    expected = expected_by_prompt[prompt]
    client = openai.OpenAI(base_url=system.http_base, api_key="unused", max_retries=0, timeout=120)
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in PROMPT_IMAGES[prompt]]
    reply = client.chat.completions.create(model=vision_worker.adapter, max_tokens=MAX_TOKENS, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": QUESTION}, *parts, {"type": "text", "text": AFTER}]}])
    assert reply.choices[0].message.content == reference.decode(expected.tokens)
    assert reply.usage.completion_tokens == len(expected.tokens)


def test_grpc_image_chat_equals_transformers_and_peft(system, vision_worker, expected_text) -> None:
    expected = expected_text[1]["one_image"]
    parts = [common_pb2.ContentPart(text=QUESTION), common_pb2.ContentPart(image=IMAGE),
             common_pb2.ContentPart(text=AFTER)]
    request = inference_pb2.GenerateRequest(
        model=vision_worker.adapter, chat=common_pb2.ChatPrompt(messages=[common_pb2.ChatMessage(role="user", parts=parts)]),
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS))
    with grpc.insecure_channel(system.gateway_grpc) as channel:
        replies = list(inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=120))
    tokens = [t for r in replies if r.HasField("delta") for t in r.delta.token_ids]
    assert_same_greedy(vision_worker.adapter, expected, tokens)


def test_bad_image_is_400_and_the_vision_worker_keeps_serving(system, vision_worker) -> None:
    body = {"model": vision_worker.adapter, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(IMAGE[:50])}}]}]}
    response = requests.post(f"{system.http_base}/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and "could not be decoded" in response.json()["error"]["message"]
    body["messages"][0]["content"][0]["image_url"]["url"] = data_url(IMAGE)  # the same request, mended
    assert requests.post(f"{system.http_base}/chat/completions", json=body, timeout=60).status_code == 200
    text_model = {**body, "model": "tessera-demo-llama"}
    response = requests.post(f"{system.http_base}/chat/completions", json=text_model, timeout=60)
    assert response.status_code == 400 and "does not take images" in response.json()["error"]["message"]
