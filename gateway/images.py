"""Images at the gateway's edge: image URLs -> bytes, and cheap checks against the configured limits.

Both doors carry an image as its encoded file (`ContentPart.image`); REST clients send it as an
OpenAI `image_url` part holding a data URL (`data:image/png;base64,iVBOR...`), or, where the operator
enabled it, an http(s) URL the gateway downloads (gateway/remote_images.py). The checks here read
only the image's header (format, width, height) and `verify` its structure, without decoding the
pixels, so a bad image is a 4xx here and never takes a worker's time; the worker decodes it fully
(and refuses what does not decode) when it builds the prompt.

Videos (`ContentPart.video`) come the same ways: a file (`video_url`: data:video/mp4 or data:video/webm, or a
remote URL under the image rules and byte limit), checked here by its container's signature only (the worker
decodes it with PyAV); or frames, each checked as an image and counted as one against max_images_per_request.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import warnings

from PIL import Image

from services.common.architectures import takes_images, takes_video
from services.common.config import GatewayConfig
from services.common.errors import InvalidArgument, PayloadTooLarge
from tessera.v1 import common_pb2, inference_pb2

from gateway.registry_cache import ResolvedModel
from gateway.remote_images import fetch_file

IMAGE_FORMATS = frozenset({"PNG", "JPEG", "WEBP"})  # what PIL's `Image.format` says
VIDEO_MEDIA_TYPES = ("data:video/mp4;", "data:video/webm;")
REMOTE_SCHEMES = ("http://", "https://")


def image_from_url(url: str, config: GatewayConfig, param: str) -> bytes:
    """An `image_url.url` -> the image file's bytes (not yet checked: check_image). A data URL, or an
    http(s) URL where `remote_images` is on: fetching for any client is the operator's choice."""
    return _file_from_url(url, config, param, "image", ("data:image/",))


def video_from_url(url: str, config: GatewayConfig, param: str) -> bytes:
    """A `video_url.url` -> the video file's bytes (not yet checked: check_video_file), by the image rules."""
    return _file_from_url(url, config, param, "video", VIDEO_MEDIA_TYPES)


def _file_from_url(url: str, config: GatewayConfig, param: str, kind: str, media_types: tuple[str, ...]) -> bytes:
    example = f"{media_types[0]}base64,..." if kind == "video" else "data:image/png;base64,..."
    if url[:8].lower().startswith(REMOTE_SCHEMES):
        if not config.remote_images:
            raise InvalidArgument(f"remote {kind} URLs are disabled on this gateway; send the {kind} inline as a "
                                  f"data URL ({example})", param=param)
        return fetch_file(url, config, param, kind)
    header, comma, payload = url.partition(",")
    if not (header.startswith(media_types) and header.endswith(";base64") and comma):
        raise InvalidArgument(f"a{'n' if kind == 'image' else ''} {kind} URL must be a base64 data URL like "
                              f"{example}", param=param)
    # Refuse by the encoded length before decoding: 4 base64 characters carry 3 bytes.
    if len(payload) // 4 * 3 > config.max_image_bytes + 2:
        raise _too_large(len(payload) // 4 * 3, config, param)
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise InvalidArgument(f"the image's data URL is not valid base64 ({exc})", param=param) from exc


def check_image(data: bytes, config: GatewayConfig, param: str) -> None:
    """Refuse an empty, oversized, undecodable, unsupported or too-large-in-pixels image file."""
    if not data:
        raise InvalidArgument("the image is empty (0 bytes)", param=param)
    if len(data) > config.max_image_bytes:
        raise _too_large(len(data), config, param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own pixel limit decides
            with Image.open(io.BytesIO(data)) as image:
                kind, (width, height) = image.format, image.size
                if kind in IMAGE_FORMATS and width * height <= config.max_image_pixels:
                    image.verify()  # structure and checksums, without decoding the pixels
    except Image.DecompressionBombError as exc:  # PIL's own ceiling, far above any sane limit
        raise InvalidArgument(f"the image has too many pixels ({exc})", param=param) from exc
    except (OSError, ValueError, SyntaxError) as exc:  # PIL raises all three for broken files
        raise InvalidArgument(f"the image could not be decoded ({exc}); send a PNG, JPEG or WebP file",
                              param=param) from exc
    if kind not in IMAGE_FORMATS:
        raise InvalidArgument(f"image format {kind} is not supported; send PNG, JPEG or WebP", param=param)
    if width * height > config.max_image_pixels:
        raise InvalidArgument(f"the image is {width}x{height} = {width * height} pixels; the limit is "
                              f"{config.max_image_pixels}", param=param)


def check_video_file(data: bytes, config: GatewayConfig, param: str) -> None:
    """Refuse an empty or oversized video file, or one that is neither MP4 nor WebM by its signature."""
    if not data:
        raise InvalidArgument("the video is empty (0 bytes)", param=param)
    if len(data) > config.max_image_bytes:
        raise PayloadTooLarge(f"the video is {len(data)} bytes; the limit is {config.max_image_bytes}", param=param)
    if data[4:8] != b"ftyp" and data[:4] != b"\x1a\x45\xdf\xa3":  # MP4's ftyp box; WebM's EBML header
        raise InvalidArgument("the video is not an MP4 or WebM file", param=param)


def check_video_options(video: common_pb2.VideoPart, param: str) -> None:
    if not (math.isfinite(video.fps) and video.fps >= 0):
        raise InvalidArgument(f"fps must be a positive number, got {video.fps}", param=f"{param}.fps")
    if video.max_frames < 0:
        raise InvalidArgument(f"max_frames must be a positive integer, got {video.max_frames}",
                              param=f"{param}.max_frames")


def _images(chat: common_pb2.ChatPrompt) -> list[tuple[str, bytes]]:
    """(field name, bytes) of every image part of a chat prompt and every frame of its videos."""
    images = []
    for i, message in enumerate(chat.messages):
        for j, part in enumerate(message.parts):
            if part.WhichOneof("part") == "image":
                images.append((f"messages[{i}].parts[{j}].image", part.image))
            elif part.WhichOneof("part") == "video":
                images.extend((f"messages[{i}].parts[{j}].video.frames.images[{k}]", frame)
                              for k, frame in enumerate(part.video.frames.images))
    return images


def _videos(chat: common_pb2.ChatPrompt) -> list[tuple[str, common_pb2.VideoPart]]:
    return [(f"messages[{i}].parts[{j}].video", part.video)
            for i, message in enumerate(chat.messages)
            for j, part in enumerate(message.parts) if part.WhichOneof("part") == "video"]


def check_chat_images(chat: common_pb2.ChatPrompt, config: GatewayConfig) -> None:
    """Check the number of images (video frames included) of a chat prompt and every one of them, and its
    videos."""
    images = _images(chat)
    check_image_count(len(images), config)
    for param, data in images:
        check_image(data, config, param)
    for param, video in _videos(chat):
        check_video_options(video, param)
        if video.WhichOneof("source") != "frames":
            check_video_file(video.file, config, f"{param}.file")


def check_image_count(count: int, config: GatewayConfig) -> None:
    """Also called on a REST request's image parts before any of them is decoded or downloaded."""
    if count > config.max_images_per_request:
        raise InvalidArgument(f"the request has {count} images; the limit is {config.max_images_per_request}",
                              param="messages")


def check_takes_images(request: inference_pb2.GenerateRequest, resolved: ResolvedModel) -> None:
    """Images only go to a vision-language base model, video only to one that takes video; its worker would
    refuse them anyway."""
    if request.WhichOneof("prompt") != "chat":
        return
    where = f"model {request.model} (base model {resolved.base_model}, {resolved.architecture})"
    if not takes_images(resolved.architecture) and (_images(request.chat) or _videos(request.chat)):
        raise InvalidArgument(f"{where} does not take images; send text only, or use a vision-language model",
                              param="messages")
    if not takes_video(resolved.architecture) and _videos(request.chat):
        raise InvalidArgument(f"{where} does not take video; send its frames as images, or use a model that "
                              "takes video (Qwen2-VL)", param="messages")


def _too_large(size: int, config: GatewayConfig, param: str) -> PayloadTooLarge:
    return PayloadTooLarge(f"the image is {size} bytes; the limit is {config.max_image_bytes}", param=param)
