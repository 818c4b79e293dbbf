"""Qwen2-VL with video in the engine: greedy tokens and log-probabilities for chat prompts with a video (frames
as images, and an MP4 decoded and sampled by fps) equal transformers' Qwen2VLForConditionalGeneration fed the
same frames; a repeated video hits the image-feature cache; what the worker refuses is a clear InvalidArgument.

transformers' Qwen2VLVideoProcessor needs torchvision, which this environment lacks: the reference gets the
input ids, pixel_values_videos and video_grid_thw of gpu_worker/vision/qwen2vl_video.py, which
test_video_pixels_equal_transformers_video_processor checks against that processor where torchvision exists.
"""

from __future__ import annotations

import functools
import io
import re
import shutil

import av
import numpy as np
import pytest
import torch

from gpu_worker.intake import GenerationRequest
from gpu_worker.models.qwen2vl import Qwen2VLImageEncoder
from gpu_worker.prompts import ChatMessage, ImagePart, Prompt, PromptEncoder
from gpu_worker.sequence import SamplingParams
from gpu_worker.vision import video as video_module
from gpu_worker.vision.qwen2vl_processor import Qwen2VLPromptProcessor
from gpu_worker.vision.qwen2vl_video import VideoProcessing
from gpu_worker.vision.video import VideoPart, decode_video, sample_indices
from services.common.errors import InvalidArgument
from tests.images import gradient_image
from tests.reference import VisionReferenceModels, assert_same_greedy

from .conftest import TinyAssets, _engines, run_all, tokens_of

MAX_NEW = 8
LOGPROB_TOLERANCE = 1e-4
# The demo template renders a video part as Qwen2-VL's does.
VIDEO_BRANCH = "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"


def _mp4(frames: np.ndarray, fps: int) -> bytes:
    """uint8 [n, height, width, 3] -> an MPEG-4 part 2 video in an MP4 container."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for pixels in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()


def _clip(frames: int, size: tuple[int, int]) -> np.ndarray:
    """A moving gradient: frames differ, so the sampled ones decide the answer."""
    rng = np.random.default_rng(7)
    height, width = size
    ramp = np.linspace(0, 255, width)[None, :, None] * rng.uniform(0.2, 1, 3)
    return np.stack([np.clip(np.roll(ramp, 6 * i, axis=1) + rng.normal(0, 30, (height, width, 3)), 0, 255)
                     .astype(np.uint8) for i in range(frames)])


MP4 = _mp4(_clip(8, (56, 56)), fps=4)  # 2 s at 4 fps: fps 2.0 samples frames 0, 2, 4, 6
FRAMES = tuple(gradient_image(20 + i, (56, 40), "PNG") for i in range(3))  # odd: the last one is repeated
PROMPTS: dict[str, Prompt] = {
    "frames": (ChatMessage("user", ("What happens? ", VideoPart(frames=FRAMES))),),
    "mp4": (ChatMessage("user", ("Describe: ", VideoPart(file=MP4), " and this ", ImagePart(FRAMES[0]))),),
}


@pytest.fixture(scope="module")
def video_assets(qwen2vl_assets) -> TinyAssets:
    """The tiny Qwen2-VL, whose chat template renders videos."""
    return TinyAssets(qwen2vl_assets.base_dir, qwen2vl_assets.store, {}, qwen2vl_assets.name)


@pytest.fixture
def video_engine_factory(video_assets):
    yield from _engines(video_assets)


@pytest.fixture(scope="module")
def processor(video_assets) -> Qwen2VLPromptProcessor:
    return Qwen2VLPromptProcessor.from_pretrained(video_assets.base_dir)


@pytest.fixture(scope="module")
def reference(video_assets, processor):
    models = VisionReferenceModels(video_assets.name, video_assets.base_dir, {}, processor=processor)

    @functools.cache
    def greedy(key: str):
        return models.greedy_inputs(video_assets.name, _model_inputs(processor, PROMPTS[key]), MAX_NEW)
    return greedy


def _model_inputs(processor: Qwen2VLPromptProcessor, prompt: Prompt) -> dict[str, torch.Tensor]:
    """What Qwen2VLProcessor gives transformers' model for `prompt`: the frames decoded as the test does
    (PyAV's rgb24, the sampled indices), then processed."""
    from PIL import Image

    messages = []
    for message in prompt:
        content = []
        for part in message.content:
            if isinstance(part, VideoPart):
                content.append({"type": "video", "video": _reference_frames(part)})
            elif isinstance(part, ImagePart):
                content.append({"type": "image", "image": Image.open(io.BytesIO(part.data))})
            else:
                content.append({"type": "text", "text": part})
        messages.append({"role": message.role, "content": content})
    return dict(processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                              return_tensors="pt"))


def _reference_frames(part: VideoPart) -> torch.Tensor:
    if part.frames:
        from PIL import Image
        return torch.from_numpy(np.stack([np.asarray(Image.open(io.BytesIO(f)).convert("RGB")) for f in part.frames]))
    with av.open(io.BytesIO(part.file)) as container:
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return torch.from_numpy(np.stack(decoded[0:8:2]))


@pytest.fixture
def encoder_calls(monkeypatch) -> list[tuple[int, ...]]:
    """Each Qwen2VLImageEncoder pass: the t of every grid it encoded."""
    calls: list[tuple[int, ...]] = []
    forward = Qwen2VLImageEncoder.forward

    def counted(self, pixel_values, grid_thw):
        calls.append(tuple(grid_thw[:, 0].tolist()))
        return forward(self, pixel_values, grid_thw)
    monkeypatch.setattr(Qwen2VLImageEncoder, "forward", counted)
    return calls


def _request(key: str, tag: str) -> GenerationRequest:
    return GenerationRequest(f"{tag}-{key}", PROMPTS[key], SamplingParams(max_tokens=MAX_NEW, logprobs=0))


def _assert_matches(reference, key: str, outputs) -> None:
    expected = reference(key)
    tokens = tokens_of(outputs)
    assert_same_greedy(key, expected, tokens)
    ours = [lp.logprob for out in outputs for lp in out.logprobs]
    for step, (token, logprob) in enumerate(zip(tokens, ours)):
        assert abs(float(expected.logprobs[step][token]) - logprob) < LOGPROB_TOLERANCE, (key, step)


def test_video_prompt_has_video_tokens_grids_and_positions(processor):
    """4 sampled 56 x 56 frames -> grid (2, 6, 6), 18 <|video_pad|> tokens; 3 frames of 56 x 40 are padded to 4 (grid (2, 4, 8))."""
    encoded = PromptEncoder(processor.tokenizer, 256, processor).encode(PROMPTS["mp4"], MAX_NEW)
    assert encoded.images.grids[0] == (2, 6, 6) and encoded.images.image_tokens[0] == 18
    assert encoded.token_ids.count(processor.video_token_id) == 18
    frames = PromptEncoder(processor.tokenizer, 256, processor).encode(PROMPTS["frames"], MAX_NEW)
    assert frames.images.grids == ((2, 4, 8),)
    inputs = _model_inputs(processor, PROMPTS["frames"])
    assert inputs["input_ids"][0].tolist() == frames.token_ids
    video_types = [2 * (t == processor.video_token_id) for t in frames.token_ids]
    assert inputs["mm_token_type_ids"][0].tolist() == video_types


@pytest.mark.parametrize("key", sorted(PROMPTS))
def test_video_matches_transformers(video_engine_factory, reference, key, encoder_calls):
    (outputs,) = run_all(video_engine_factory(image_cache_bytes=0), [_request(key, "match")])
    _assert_matches(reference, key, outputs)
    assert len(encoder_calls) == 1 and encoder_calls[0][0] == 2  # the video (and the image) in one pass


def test_video_changes_the_reference_output(reference):
    """Guards the test's power: another sampling of the file's frames changes the greedy tokens."""
    assert reference("mp4").tokens != reference("frames").tokens


def test_repeated_video_hits_the_feature_cache(video_engine_factory, reference, encoder_calls):
    engine = video_engine_factory()
    for i in range(2):
        (outputs,) = run_all(engine, [_request("frames", f"cached-{i}")])
        _assert_matches(reference, "frames", outputs)
    assert encoder_calls == [(2,)]  # the second request took the video's features from the cache


def test_sampling_follows_fps_and_max_frames():
    assert sample_indices(60, 30.0, 2.0, 64) == [0, 15, 30, 45]   # 2 s: 4 frames
    assert sample_indices(300, 30.0, 2.0, 64) == list(range(0, 300, 15))  # 10 s: 20 frames
    assert sample_indices(300, 30.0, 2.0, 7) == [0, 50, 100, 150, 200, 250]  # at most 7: an even 6
    assert sample_indices(1, 30.0, 2.0, 64) == [0]


def test_video_pixels_equal_transformers_video_processor(video_assets):
    pytest.importorskip("torchvision")
    from transformers import AutoVideoProcessor

    theirs = AutoVideoProcessor.from_pretrained(video_assets.base_dir)
    ours = VideoProcessing.from_pretrained(video_assets.base_dir)
    for frames in (torch.from_numpy(_clip(4, (56, 56))), torch.from_numpy(_clip(3, (40, 72)))):
        want = theirs(videos=[frames.numpy()], return_tensors="pt", do_sample_frames=False, cap_pixels_per_frame=False)
        pixels, grid = ours(frames)
        assert [list(grid)] == want["video_grid_thw"].tolist()
        torch.testing.assert_close(pixels, want["pixel_values_videos"], rtol=0, atol=0)


def _refused(video: VideoPart, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        decode_video(video, 0)


def test_refused_videos_say_why(monkeypatch):
    _refused(VideoPart(frames=(gradient_image(1, (8, 8), "PNG"),) * 3, max_frames=2), "3 frames; the limit is 2")
    _refused(VideoPart(file=MP4, max_frames=10_000), "max_frames must be between 1 and")
    _refused(VideoPart(file=MP4, fps=-1.0), "fps must be a positive number")
    _refused(VideoPart(frames=(gradient_image(1, (8, 8), "PNG"), gradient_image(2, (8, 9), "PNG"))),
             "frames differ in size")
    _refused(VideoPart(file=b"\x00\x01 not a video at all" * 10), "not a decodable video")
    _refused(VideoPart(file=gradient_image(1, (8, 8), "PNG")), "not an MP4 or WebM video|not a decodable video")
    monkeypatch.setattr(video_module, "MAX_SECONDS", 1.5)
    _refused(VideoPart(file=MP4), r"2\.0 s long; the limit is 1\.5 s")
    monkeypatch.undo()
    monkeypatch.setattr(video_module, "MAX_FRAME_PIXELS", 1000)
    _refused(VideoPart(file=MP4), "56x56 = 3136 pixels; the limit is 1000")
    _refused(VideoPart(frames=FRAMES), "56x40 = 2240 pixels; the limit is 1000")


def test_models_without_video_refuse_it(tiny_assets, llava_assets):
    from transformers import AutoProcessor, AutoTokenizer

    prompt = (ChatMessage("user", ("What happens? ", VideoPart(frames=FRAMES))),)
    text = PromptEncoder(AutoTokenizer.from_pretrained(tiny_assets.base_dir), 256)
    llava = AutoProcessor.from_pretrained(llava_assets.base_dir)
    for encoder in (text, PromptEncoder(llava.tokenizer, 256, llava)):
        with pytest.raises(InvalidArgument, match="this model does not take video"):
            encoder.encode(prompt, MAX_NEW)


def test_template_without_video_is_refused(qwen2vl_assets, tmp_path):
    """A template that renders no video placeholder: the video does not fit the text (a 400, not a crash)."""
    base = tmp_path / "base"
    shutil.copytree(qwen2vl_assets.base_dir, base)
    template = base / "chat_template.jinja"
    text = template.read_text()
    assert VIDEO_BRANCH in text
    template.write_text(text.replace(VIDEO_BRANCH, ""))
    processor = Qwen2VLPromptProcessor.from_pretrained(base)
    with pytest.raises(InvalidArgument, match=re.escape("0 <|video_pad|> tokens and 1 videos")):
        PromptEncoder(processor.tokenizer, 256, processor).encode(PROMPTS["frames"], MAX_NEW)
