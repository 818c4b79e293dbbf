"""Task heads through the running system: POST /v1/classify and gRPC Classify on the demo head adapters
(`tessera demo-assets` registers them; the registry derives their heads from the files), equal to
transformers + PEFT (the SEQ_CLS classifier) and to the plain-torch head over transformers + PEFT's hidden
states (Qwen2-VL's action head, with an image); a video classified; the 400s."""

from __future__ import annotations

import io
import json

import grpc
import pytest
import requests
import torch
from PIL import Image

from benchmarks.harness.live_system import RunningSystem
from gpu_worker.vision.qwen2vl_processor import Qwen2VLPromptProcessor
from services.common.adapter_layout import CONFIG_FILE
from services.common.task_heads import TaskHead
from services.demo_assets import DEMO_QWEN2VL_BASE_MODEL
from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.images import data_url, gradient_image
from tests.reference import VisionReferenceModels, head_tensors, mlp_head_probs, peft_classifier_probs

pytestmark = pytest.mark.integration

TOLERANCE = 1e-5
TEXTS = ("def main():\n    return 1\n", "import os\n")
IMAGE = gradient_image(3, (48, 40), "PNG")
FRAMES = [gradient_image(30 + i, (48, 40), "PNG") for i in range(4)]


def _classify(system: RunningSystem, body: dict) -> requests.Response:
    return requests.post(f"{system.http_base}/classify", json=body, timeout=120)


def _labels(system: RunningSystem, adapter: str) -> list[str]:
    return list(json.loads((system.home / "models" / "adapters" / adapter / CONFIG_FILE).read_text())["id2label"].values())


def test_rest_and_grpc_classify_equal_peft_sequence_classification(system: RunningSystem) -> None:
    models = system.home / "models"
    expected = [peft_classifier_probs(models / "tessera-demo-llama", models / "adapters" / "demo-classifier", 3, text)
                for text in TEXTS]
    response = _classify(system, {"model": "demo-classifier", "input": list(TEXTS)})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == "demo-classifier" and body["id"].startswith("classify-")
    labels = _labels(system, "demo-classifier")
    for index, (item, want) in enumerate(zip(body["data"], expected)):
        assert item["index"] == index and item["num_classes"] == 3
        assert torch.allclose(torch.tensor(item["probs"]), want, atol=TOLERANCE), (item["probs"], want)
        assert item["label"] == labels[int(want.argmax())]
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] == 0

    request = inference_pb2.ClassifyRequest(model="demo-classifier", inputs=[inference_pb2.ClassifyInput(text=t)
                                                                            for t in TEXTS])
    with grpc.insecure_channel(system.gateway_grpc) as channel:
        reply = inference_pb2_grpc.InferenceStub(channel).Classify(request, timeout=120)
    for result, want in zip(reply.results, expected):
        assert torch.allclose(torch.tensor(list(result.probs)), want, atol=TOLERANCE)


def test_qwen2vl_action_head_on_an_image_equals_the_reference_and_answers_a_video(system: RunningSystem) -> None:
    models = system.home / "models"
    base_dir, adapter_dir = models / DEMO_QWEN2VL_BASE_MODEL, models / "adapters" / "demo-qwen2vl-action"
    question = "What is happening? "
    response = _classify(system, {"model": "demo-qwen2vl-action", "messages": [{"role": "user", "content": [
        {"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": data_url(IMAGE)}}]}]})
    assert response.status_code == 200, response.text
    (item,) = response.json()["data"]

    reference = VisionReferenceModels(DEMO_QWEN2VL_BASE_MODEL, base_dir, {"action": adapter_dir},
                                      processor=Qwen2VLPromptProcessor.from_pretrained(base_dir))
    inputs = reference.message_inputs([{"role": "user", "content": [
        {"type": "text", "text": question}, {"type": "image", "image": Image.open(io.BytesIO(IMAGE))}]}])
    head = TaskHead.from_json(system.admin("/adapters/demo-qwen2vl-action")["task_head"])
    want = mlp_head_probs(head_tensors(adapter_dir), head, reference.final_hidden("action", inputs))
    assert torch.allclose(torch.tensor(item["probs"]), want, atol=TOLERANCE), (item["probs"], want)
    assert item["label"] == head.labels[int(want.argmax())] and item["num_classes"] == len(head.labels)

    video = {"model": "demo-qwen2vl-action", "messages": [{"role": "user", "content": [
        {"type": "text", "text": question}, {"type": "video", "video": [data_url(f) for f in FRAMES]}]}]}
    answers = [_classify(system, video) for _ in range(2)]
    assert all(a.status_code == 200 for a in answers), answers[0].text
    first, again = (a.json()["data"][0] for a in answers)
    assert first["label"] in head.labels and sum(first["probs"]) == pytest.approx(1.0, abs=1e-5)
    assert first["probs"] == pytest.approx(again["probs"], abs=TOLERANCE)  # the second from the feature cache


def test_llava_detection_head_answers_boxes(system: RunningSystem) -> None:
    response = _classify(system, {"model": "demo-llava-detect", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Find the animals. "}, {"type": "image_url", "image_url": {"url": data_url(IMAGE)}}]}]})
    assert response.status_code == 200, response.text
    (item,) = response.json()["data"]
    head = TaskHead.from_json(system.admin("/adapters/demo-llava-detect")["task_head"])
    assert len(item["detections"]) <= head.positions
    scores = [d["score"] for d in item["detections"]]
    assert scores == sorted(scores, reverse=True) and all(s >= head.score_threshold for s in scores)
    for detection in item["detections"]:
        x1, y1, x2, y2 = detection["box"]
        assert detection["label"] in head.labels and 0 <= x1 <= x2 <= 1 and 0 <= y1 <= y2 <= 1


@pytest.mark.parametrize("case", ["head adapter to chat", "plain adapter to classify", "no input"])
def test_refusals_are_400_and_name_the_cause(system: RunningSystem, case: str) -> None:
    if case == "head adapter to chat":
        response = requests.post(f"{system.http_base}/chat/completions", timeout=60, json={
            "model": "demo-classifier", "messages": [{"role": "user", "content": "hi"}]})
        cause = "/v1/classify"
    else:
        body = {"model": "demo-r8", "input": "hi"} if case == "plain adapter to classify" else {"model": "demo-classifier"}
        response = _classify(system, body)
        cause = "no task head" if case == "plain adapter to classify" else "input"
    assert response.status_code == 400 and cause in response.json()["error"]["message"], response.text
