"""A request's video -> its frames: an encoded file (MP4, WebM) decoded with PyAV and sampled, or a list of
encoded images taken as they are. Runs on the worker's intake threads, like image decoding.

A file is sampled as transformers' Qwen2VLVideoProcessor.sample_frames does with `fps`: of N frames at
the file's F frames per second, n = N / F * fps frames (at least MIN_FRAMES, at most `max_frames` and N),
rounded down to a multiple of TEMPORAL_PATCH, at indices int(k * N / n). A 3 s clip at 30 fps, fps 2.0:
n = 6, frames 0, 15, 30, 45, 60, 75. Everything over the limits below is an InvalidArgument (a 400).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import av
import numpy as np
import torch

from gpu_worker.vision.images import decode_image
from services.common.errors import InvalidArgument

DEFAULT_FPS = 2.0          # frames sampled per second of a file: Qwen2-VL's video processor's default
MAX_FRAMES = 64            # frames one video may bring to the vision tower
MAX_FRAME_PIXELS = 1920 * 1088  # width * height of one frame
MAX_SECONDS = 600.0        # a file's duration
MIN_FRAMES = 4             # the sampler's floor, as Qwen2VLVideoProcessor's min_frames
TEMPORAL_PATCH = 2         # Qwen2-VL's temporal_patch_size: sampled counts are multiples of it
CONTAINERS = ("mp4", "mov", "webm", "matroska")  # names in PyAV's format.name ("mov,mp4,m4a,3gp,3g2,mj2")


@dataclass(frozen=True)
class VideoPart:
    """A request's video: the encoded file, or encoded frames in time order (exactly one of the two)."""
    file: bytes = b""
    frames: tuple[bytes, ...] = ()
    fps: float = 0.0     # frames sampled per second of the file; 0: DEFAULT_FPS
    max_frames: int = 0  # 0: MAX_FRAMES

    def __post_init__(self) -> None:
        assert bool(self.file) != bool(self.frames), "a video is a file or frames"


def decode_video(video: VideoPart, index: int) -> torch.Tensor:
    """-> the frames to process, uint8 [frames, height, width, 3] (RGB). `index` numbers the video in its
    request, for the messages."""
    fps = video.fps or DEFAULT_FPS
    if not (math.isfinite(fps) and fps > 0):
        raise InvalidArgument(f"video {index}: fps must be a positive number, got {video.fps}", param="messages")
    if not 0 <= video.max_frames <= MAX_FRAMES:
        raise InvalidArgument(f"video {index}: max_frames must be between 1 and {MAX_FRAMES}, got "
                              f"{video.max_frames}", param="messages")
    max_frames = video.max_frames or MAX_FRAMES
    if video.frames:
        if len(video.frames) > max_frames:
            raise InvalidArgument(f"video {index} has {len(video.frames)} frames; the limit is {max_frames}",
                                  param="messages")
        frames = [np.asarray(decode_image(data, index).convert("RGB")) for data in video.frames]
    else:
        frames = _decode_file(video.file, fps, max_frames, index)
    sizes = {frame.shape[:2] for frame in frames}
    if len(sizes) > 1:
        raise InvalidArgument(f"video {index}'s frames differ in size ({sorted(sizes)}); send frames of one size",
                              param="messages")
    height, width = sizes.pop()
    _check_pixels(width, height, index)
    return torch.from_numpy(np.stack(frames))


def sample_indices(total: int, file_fps: float, fps: float, max_frames: int) -> list[int]:
    """Which of a file's `total` frames to keep (module docstring); a 1-frame file keeps its frame."""
    most = min(max_frames, total) // TEMPORAL_PATCH * TEMPORAL_PATCH
    if most == 0:
        return list(range(total))
    count = min(max(total / file_fps * fps, MIN_FRAMES), most) // TEMPORAL_PATCH * TEMPORAL_PATCH
    return torch.arange(0, total, total / count).int().tolist()


def _decode_file(data: bytes, fps: float, max_frames: int, index: int) -> list[np.ndarray]:
    """Count the file's frames (demuxing, no decoding), check its duration, then decode and keep the sampled
    ones as RGB arrays [height, width, 3]."""
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video or not any(c in container.format.name for c in CONTAINERS):
                raise InvalidArgument(f"video {index} is not an MP4 or WebM video (format {container.format.name})",
                                      param="messages")
            stream = container.streams.video[0]
            file_fps = float(stream.average_rate or stream.guessed_rate or 0)
            total = sum(1 for packet in container.demux(stream) if packet.size)
            if total == 0 or file_fps <= 0:
                raise InvalidArgument(f"video {index} has no frames to decode", param="messages")
            if total / file_fps > MAX_SECONDS:
                raise InvalidArgument(f"video {index} is {total / file_fps:.1f} s long; the limit is "
                                      f"{MAX_SECONDS:g} s", param="messages")
            _check_pixels(stream.width, stream.height, index)  # before decoding any frame
            keep = set(sample_indices(total, file_fps, fps, max_frames))
            container.seek(0)
            frames = [frame.to_ndarray(format="rgb24")
                      for i, frame in enumerate(container.decode(stream)) if i in keep]
    except (av.error.FFmpegError, ValueError) as exc:
        raise InvalidArgument(f"video {index} is not a decodable video ({exc})", param="messages") from exc
    if len(frames) != len(keep):
        raise InvalidArgument(f"video {index} is not a decodable video ({len(frames)} of {len(keep)} sampled "
                              "frames decoded)", param="messages")
    return frames


def _check_pixels(width: int, height: int, index: int) -> None:
    if width * height > MAX_FRAME_PIXELS:
        raise InvalidArgument(f"video {index}'s frames are {width}x{height} = {width * height} pixels; the limit "
                              f"is {MAX_FRAME_PIXELS}", param="messages")
