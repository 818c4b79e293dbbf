"""Images through both front doors, to fake workers: a good image reaches a vision model's worker byte for
byte and in order with the text; every bad image is a clear 400 (413 for too many bytes) over REST and
INVALID_ARGUMENT over gRPC, never reaches a worker, and the gateway goes on serving."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Iterator

import grpc
import pytest
import requests
from PIL import Image

from tests.images import data_url, gradient_image
from tests.unit.gateway.gateway_fakes import BASE, FakeWorker, GatewayEnv
from tests.unit.gateway.image_server import ImageServer
from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc

VISION_BASE = "tiny-llava"
MAX_BYTES, MAX_IMAGES, MAX_PIXELS = 4000, 2, 64 * 64
PNG = gradient_image(1, (24, 16), "PNG")
JPEG = gradient_image(2, (16, 16), "JPEG")
WEBP = gradient_image(3, (20, 12), "WEBP")
LARGE_PNG = gradient_image(4, (60, 60), "PNG")    # under MAX_PIXELS, over MAX_BYTES


def _solid_png(size: tuple[int, int]) -> bytes:
    """One colour: few bytes for many pixels."""
    out = io.BytesIO()
    Image.new("RGB", size, (200, 30, 90)).save(out, format="PNG")
    return out.getvalue()


MANY_PIXELS_PNG = _solid_png((65, 64))


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` (valid checksum), over a 1x1 image's data: what a
    decompression bomb looks like before its pixels are decoded."""
    png = gradient_image(7, (1, 1), "PNG")
    ihdr = b"IHDR" + struct.pack(">II", width, height) + png[24:29]
    return png[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + png[33:]


@pytest.fixture(scope="module")
def env() -> Iterator[GatewayEnv]:
    env = GatewayEnv()
    env.registry.base_models.append(common_pb2.BaseModel(name=VISION_BASE, architecture="LlavaForConditionalGeneration"))
    env.add_worker(FakeWorker(name="vision"), base_model=VISION_BASE)
    gw = env.config.gateway  # the running gateway reads this object per request
    gw.max_image_bytes, gw.max_images_per_request, gw.max_image_pixels = MAX_BYTES, MAX_IMAGES, MAX_PIXELS
    env.refresh()
    yield env
    env.close()


def _sent(env: GatewayEnv) -> list:
    return [r for w in env.workers for r in w.requests]


def _chat(*parts: dict, model: str = VISION_BASE) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": list(parts)}], "max_tokens": 2}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _post(env: GatewayEnv, body: dict) -> requests.Response:
    return requests.post(f"{env.http_base}/v1/chat/completions", json=body, timeout=20)


def test_images_reach_the_worker_in_order_with_the_text(env: GatewayEnv) -> None:
    body = _chat(_text("Compare "), _image(data_url(PNG)), _text(" with "), _image(data_url(JPEG, "image/jpeg")))
    response = _post(env, body)
    assert response.status_code == 200, response.text
    parts = env.workers[-1].requests[-1].chat.messages[0].parts
    assert [p.WhichOneof("part") for p in parts] == ["text", "image", "text", "image"]
    assert (parts[0].text, parts[1].image, parts[2].text, parts[3].image) == ("Compare ", PNG, " with ", JPEG)


def test_webp_and_text_only_parts(env: GatewayEnv) -> None:
    assert _post(env, _chat(_image(data_url(WEBP, "image/webp")))).status_code == 200
    assert _post(env, _chat(_text("a"), _text("b"))).status_code == 200
    message = env.workers[-1].requests[-1].chat.messages[0]
    assert message.content == "a\nb" and not message.parts, "text-only parts stay one string, as before images"


@pytest.mark.parametrize(("url", "status", "phrase"), [
    (data_url(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 8), 400, "could not be decoded"),
    (data_url(PNG[:60]), 400, "could not be decoded"),                        # truncated
    ("data:image/png;base64,iVBOR%%%not-base64", 400, "not valid base64"),
    ("data:image/png;base64,", 400, "the image is empty (0 bytes)"),
    (data_url(_png_claiming(100_000, 100_000)), 400, "too many pixels"),     # past PIL's bomb ceiling
    (data_url(MANY_PIXELS_PNG), 400, f"65x64 = 4160 pixels; the limit is {MAX_PIXELS}"),
    (data_url(gradient_image(8, (8, 8), "GIF"), "image/gif"), 400, "format GIF is not supported"),
    (data_url(gradient_image(9, (8, 8), "BMP"), "image/bmp"), 400, "format BMP is not supported"),
    (data_url(LARGE_PNG), 413, f"; the limit is {MAX_BYTES}"),
    ("https://example.com/cat.png", 400, "remote image URLs are disabled"),
    ("data:text/plain;base64,aGVsbG8=", 400, "must be a base64 data URL"),
], ids=["corrupt", "truncated", "bad-base64", "empty", "bomb-header", "too-many-pixels", "gif", "bmp",
        "too-many-bytes", "remote-url", "not-an-image-url"])
def test_bad_image_is_a_clear_4xx(env: GatewayEnv, url: str, status: int, phrase: str) -> None:
    before = len(_sent(env))
    response = _post(env, _chat(_text("What is this? "), _image(url)))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert phrase in error["message"]
    assert error["param"] == "messages[0].content[1]" and error["type"] == "invalid_request_error"
    assert len(_sent(env)) == before, "a bad image never reaches a worker"
    assert _post(env, _chat(_text("still there? "), _image(data_url(PNG)))).status_code == 200


def test_remote_image_url_when_enabled(env: GatewayEnv) -> None:
    """Off (above: "remote-url"), then on for a loopback server: the downloaded bytes reach the worker;
    a failed download is a 400 naming the part."""
    gw = env.config.gateway
    with ImageServer({"/cat.png": PNG}) as server:
        assert _post(env, _chat(_image(server.url("/cat.png")))).status_code == 400
        assert server.paths == []
        gw.remote_images = gw.remote_image_allow_private = True
        try:
            response = _post(env, _chat(_text("What is this? "), _image(server.url("/cat.png"))))
            assert response.status_code == 200, response.text
            assert env.workers[-1].requests[-1].chat.messages[0].parts[1].image == PNG
            before = len(_sent(env))
            response = _post(env, _chat(_text("And this? "), _image(server.url("/missing"))))
            assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].content[1]"
            assert "answered HTTP 404" in response.json()["error"]["message"] and len(_sent(env)) == before
        finally:
            gw.remote_images = gw.remote_image_allow_private = False


@pytest.mark.parametrize(("body", "param", "phrase"), [
    (_chat(*[_image(data_url(PNG))] * (MAX_IMAGES + 1)), "messages", f"3 images; the limit is {MAX_IMAGES}"),
    (_chat(_image(data_url(PNG)), model=BASE), "messages", "does not take images"),
    (_chat({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}), "messages[0].content[0].image_url",
     "image_url must be an object"),
    (_chat({"type": "input_audio", "input_audio": {}}), "messages[0].content[0].type",
     'must be one of "text", "image_url", "video_url", "video", got "input_audio"'),
], ids=["too-many-images", "text-model", "url-not-object", "unknown-part"])
def test_bad_image_requests_are_400(env: GatewayEnv, body: dict, param: str, phrase: str) -> None:
    before = len(_sent(env))
    response = _post(env, body)
    assert response.status_code == 400, response.text
    assert phrase in response.json()["error"]["message"] and response.json()["error"]["param"] == param
    assert len(_sent(env)) == before


# gRPC: the same checks on ContentPart.image, INVALID_ARGUMENT with the same messages.

@pytest.fixture(scope="module")
def stub(env: GatewayEnv) -> Iterator[inference_pb2_grpc.InferenceStub]:
    with grpc.insecure_channel(env.grpc_address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def _grpc_request(*parts: common_pb2.ContentPart, model: str = VISION_BASE,
                  content: str = "") -> inference_pb2.GenerateRequest:
    message = common_pb2.ChatMessage(role="user", content=content, parts=parts)
    return inference_pb2.GenerateRequest(model=model, chat=common_pb2.ChatPrompt(messages=[message]),
                                         sampling=common_pb2.SamplingParams(max_tokens=2))


def test_grpc_images_reach_the_worker(env: GatewayEnv, stub: inference_pb2_grpc.InferenceStub) -> None:
    frames = [common_pb2.ContentPart(image=gradient_image(20 + i, (8, 8), "PNG")) for i in range(MAX_IMAGES)]
    responses = list(stub.Generate(_grpc_request(common_pb2.ContentPart(text="Frames:"), *frames), timeout=10))
    assert responses[-1].WhichOneof("payload") == "final"
    assert list(env.workers[-1].requests[-1].chat.messages[0].parts) == [common_pb2.ContentPart(text="Frames:"),
                                                                       *frames]


@pytest.mark.parametrize(("request_", "phrase"), [
    (_grpc_request(common_pb2.ContentPart(image=b"GIF89a broken")), "could not be decoded"),
    (_grpc_request(common_pb2.ContentPart(image=b"")), "the image is empty"),
    (_grpc_request(common_pb2.ContentPart(image=LARGE_PNG)), f"; the limit is {MAX_BYTES}"),
    (_grpc_request(common_pb2.ContentPart(image=MANY_PIXELS_PNG)), "4160 pixels"),
    (_grpc_request(common_pb2.ContentPart(image=gradient_image(8, (8, 8), "GIF"))), "format GIF is not supported"),
    (_grpc_request(*[common_pb2.ContentPart(image=PNG)] * (MAX_IMAGES + 1)), "3 images; the limit is 2"),
    (_grpc_request(common_pb2.ContentPart(image=PNG), model=BASE), "does not take images"),
    (_grpc_request(common_pb2.ContentPart(image=PNG), content="and text"), "has both content and parts"),
], ids=["corrupt", "empty", "too-many-bytes", "too-many-pixels", "gif", "too-many-images", "text-model",
        "content-and-parts"])
def test_grpc_bad_image_is_invalid_argument(env: GatewayEnv, stub: inference_pb2_grpc.InferenceStub,
                                            request_: inference_pb2.GenerateRequest, phrase: str) -> None:
    before = len(_sent(env))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request_, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and phrase in info.value.details()
    assert len(_sent(env)) == before
    assert list(stub.Generate(_grpc_request(common_pb2.ContentPart(image=PNG)), timeout=10))
