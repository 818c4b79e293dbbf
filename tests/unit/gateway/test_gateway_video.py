"""REST video parts: `video_url` (a data URL of an MP4 or WebM file, fps, max_frames) and `video` (frame URLs)
become ContentPart.video; what the gateway can tell is wrong without decoding is a 400 (413 when too large)
naming the field."""

from __future__ import annotations

import pytest

from gateway.images import check_takes_images
from gateway.registry_cache import ResolvedModel
from gateway.schemas import parse_chat_request
from services.common.config import GatewayConfig
from services.common.errors import InvalidArgument, PayloadTooLarge
from tests.images import data_url, gradient_image

CONFIG = GatewayConfig(max_images_per_request=4, max_image_bytes=4096)
MP4 = b"\x00\x00\x00\x18ftypisom" + bytes(64)  # the signature is all the gateway reads
WEBM = b"\x1a\x45\xdf\xa3" + bytes(64)
FRAME = data_url(gradient_image(1, (8, 8), "PNG"))


def _chat(*parts: dict) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "What happens?"},
                                                                    *parts]}]}


def _video(url: str, **options) -> dict:
    return {"type": "video_url", "video_url": {"url": url, **options}}


def test_video_url_becomes_a_video_part_with_its_options():
    request = parse_chat_request(_chat(_video(data_url(MP4, "video/mp4"), fps=1.5, max_frames=8)), CONFIG).generate
    video = request.chat.messages[0].parts[1].video
    assert (video.file, video.fps, video.max_frames) == (MP4, 1.5, 8)
    webm = parse_chat_request(_chat(_video(data_url(WEBM, "video/webm"))), CONFIG).generate
    assert webm.chat.messages[0].parts[1].video.file == WEBM


def test_frames_become_a_video_part_in_order():
    frames = [gradient_image(i, (8, 8), "PNG") for i in range(3)]
    request = parse_chat_request(_chat({"type": "video", "video": [data_url(f) for f in frames]}), CONFIG).generate
    assert list(request.chat.messages[0].parts[1].video.frames.images) == frames


@pytest.mark.parametrize("part, error, match", [
    (_video(data_url(b"GIF89a" + bytes(64), "video/mp4")), InvalidArgument, "not an MP4 or WebM file"),
    (_video(data_url(MP4, "video/avi")), InvalidArgument, "video URL must be a base64 data URL"),
    (_video(data_url(MP4, "image/png")), InvalidArgument, "video URL must be a base64 data URL"),
    (_video("https://example.com/clip.mp4"), InvalidArgument, "remote video URLs are disabled"),
    (_video(data_url(MP4 + bytes(8192), "video/mp4")), PayloadTooLarge, "limit is 4096"),
    (_video(data_url(MP4, "video/mp4"), fps=0), InvalidArgument, "fps"),
    (_video(data_url(MP4, "video/mp4"), max_frames=0), InvalidArgument, "max_frames"),
    ({"type": "video", "video": [FRAME] * 5}, InvalidArgument, "5 images; the limit is 4"),
    ({"type": "video", "video": [FRAME, data_url(b"not a png")]}, InvalidArgument, "image could not be decoded"),
    ({"type": "video", "video": []}, InvalidArgument, "video"),
    ({"type": "video_url"}, InvalidArgument, "video_url"),
])
def test_bad_videos_are_refused_naming_the_field(part, error, match):
    with pytest.raises(error, match=match):
        parse_chat_request(_chat(part), CONFIG)


@pytest.mark.parametrize("architecture, refused", [
    ("Qwen2VLForConditionalGeneration", None),
    ("LlavaForConditionalGeneration", "does not take video"),
    ("LlamaForCausalLM", "does not take images"),
])
def test_video_goes_only_to_a_model_that_takes_video(architecture, refused):
    request = parse_chat_request(_chat(_video(data_url(MP4, "video/mp4"))), CONFIG).generate
    resolved = ResolvedModel("base", None, architecture)
    if refused is None:
        check_takes_images(request, resolved)
        return
    with pytest.raises(InvalidArgument, match=refused):
        check_takes_images(request, resolved)
