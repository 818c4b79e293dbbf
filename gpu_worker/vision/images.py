"""A prompt's images on their way into the language model.

The model's processor turns each image into pixel values, and the image's placeholder in the prompt
into as many image tokens as the vision encoder makes features for it (LLaVA-1.5 at 336 px: 576 for
every image; Qwen2-VL: one per 2 x 2 merged patches, so as many as the image's size gives). The
encoder's features replace those tokens' embeddings in order: feature k goes to the prompt's k-th
image token. A prompt with two 4-token images:

    positions   0 1 2 3 4 5 6 7 8 9 10 11 12
    image tokens    2 3 4 5     8 9 10 11          token_runs ((2, 4), (8, 4))
    features        0 1 2 3     4 5 6  7           image_tokens (4, 4)

A prefill chunk over positions [5, 10) takes feature 3 at position 5 and features 4, 5 at 8, 9.
"""

from __future__ import annotations

import bisect
import io
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from PIL import Image

from gpu_worker.layers.mrope import MRopePositions, rope_index
from gpu_worker.lora.loader import TowerWeights
from services.common.errors import InvalidArgument


@dataclass(frozen=True)
class PromptImages:
    # [num_images] each image's pixel values as the image processor made them (LLaVA: [channels, height,
    # width]; Qwen2-VL: [patches, channels * temporal_patch * patch * patch], patches = t * h * w of its grid)
    pixel_values: tuple[torch.Tensor, ...]
    token_runs: tuple[tuple[int, int], ...]    # (first position, length) of each run of consecutive image tokens
    digests: tuple[str, ...]                   # [num_images] sha256 of each image's encoded bytes
    image_tokens: tuple[int, ...]              # [num_images] each image's tokens (= its features)
    grids: tuple[tuple[int, int, int], ...] | None = None  # Qwen2-VL: each image's (t, h, w) patch grid
    positions: MRopePositions | None = None    # Qwen2-VL: the prompt's M-RoPE positions, which the grids decide

    def __post_init__(self) -> None:
        assert self.token_runs, "a prompt with images has image tokens"
        assert len(self.digests) == len(self.pixel_values) == len(self.image_tokens), (
            len(self.digests), len(self.pixel_values), self.image_tokens)
        assert sum(self.image_tokens) == self.num_tokens, (self.image_tokens, self.token_runs)
        assert self.grids is None or len(self.grids) == len(self.digests), (self.grids, self.digests)

    @property
    def num_tokens(self) -> int:
        return sum(length for _, length in self.token_runs)

    @property
    def end(self) -> int:
        """One past the last image token: once the KV cache holds the prompt up to here, no step
        needs the features again (unless the sequence is preempted and recomputed)."""
        start, length = self.token_runs[-1]
        return start + length

    def rows_in(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """(position, feature, count) for the image tokens among positions [start, end): positions
        [position, position + count) take features [feature, feature + count)."""
        feature = 0
        for run_start, length in self.token_runs:
            lo, hi = max(run_start, start), min(run_start + length, end)
            if lo < hi:
                yield lo, feature + lo - run_start, hi - lo
            feature += length

    def content_in(self, start: int, end: int) -> tuple[tuple[int, str, int], ...]:
        """(position, image digest, feature index within that image) of each image token among
        positions [start, end): what, beyond the token ids, decides those positions' K/V."""
        firsts = [0, *itertools.accumulate(self.image_tokens)][:-1]  # each image's first feature
        content = []
        for position, feature, count in self.rows_in(start, end):
            for f in range(feature, feature + count):
                image = bisect.bisect_right(firsts, f) - 1
                content.append((position + f - feature, self.digests[image], f - firsts[image]))
        return tuple(content)


def fixed_size_images(pixel_values: torch.Tensor, token_runs: tuple[tuple[int, int], ...],
                      digests: tuple[str, ...]) -> PromptImages:
    """Images of one size (LLaVA-1.5): pixel_values [num_images, channels, height, width], as many tokens each."""
    tokens, rest = divmod(sum(length for _, length in token_runs), len(digests))
    assert rest == 0, f"{len(digests)} images share {token_runs} image tokens unevenly"
    return PromptImages(tuple(pixel_values.unbind(0)), token_runs, digests, (tokens,) * len(digests))


def grid_images(num_prompt_tokens: int, visuals: list[tuple[torch.Tensor, tuple[int, int, int]]],
                token_runs: tuple[tuple[int, int], ...], digests: tuple[str, ...], merge: int) -> PromptImages:
    """Images and videos at their own resolution (Qwen2-VL): each one's (pixel values [t * h * w, patch dim],
    grid (t, h, w)) in prompt order (an image has t = 1, a video one per 2 frames); each has t * h * w / merge^2
    tokens, and the prompt M-RoPE positions. Runs are one per image or video (vision start/end tokens part them)."""
    grids = tuple(grid for _, grid in visuals)
    assert len(grids) == len(token_runs) == len(digests), (grids, token_runs, digests)
    pixels = tuple(pixel_values for pixel_values, _ in visuals)
    assert all(p.shape[0] == t * h * w for p, (t, h, w) in zip(pixels, grids)), (grids, [p.shape for p in pixels])
    image_tokens = tuple(t * h * w // merge ** 2 for t, h, w in grids)
    rows, delta = rope_index(num_prompt_tokens, token_runs, list(grids), merge)
    positions = MRopePositions(tuple(map(tuple, rows)), delta, (token_runs[0][0], sum(token_runs[-1])))
    return PromptImages(pixels, token_runs, digests, image_tokens, grids, positions)


def image_token_runs(token_ids: list[int], image_token_ids: set[int]) -> tuple[tuple[int, int], ...]:
    """The runs of consecutive `image_token_ids` (Qwen2-VL: its image and video tokens) in `token_ids`, as
    (first position, length)."""
    runs: list[tuple[int, int]] = []
    for position, token in enumerate(token_ids):
        if token not in image_token_ids:
            continue
        if runs and sum(runs[-1]) == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return tuple(runs)


@dataclass(frozen=True)
class EncoderImage:
    """One image (or video) of an encoder pass, and the tower LoRA it goes through."""
    pixel_values: torch.Tensor                # as in PromptImages.pixel_values
    grid: tuple[int, int, int] | None = None  # Qwen2-VL: its (t, h, w) patch grid
    tower: TowerWeights | None = None         # its adapter's tower LoRA; None: the base tower


class ImageEncoder(Protocol):
    def encode(self, images: list[EncoderImage]) -> list[torch.Tensor]:
        """`images`, of any prompts and adapters, through the vision tower in one pass (LLaVA: one per
        image size) -> each one's features [its image tokens, hidden], in order: what replaces its tokens'
        embeddings. Images that share a tower LoRA must share its TowerWeights object."""


def decode_image(data: bytes, index: int) -> Image.Image:
    """Encoded image bytes (PNG, JPEG, WebP, ...) -> a decoded PIL image; InvalidArgument if they do not
    decode. `index` numbers the image in its request, for the message."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # decode now: a truncated file fails here, not inside the image processor
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidArgument(f"image {index} is not a decodable image ({exc})", param="messages") from exc
    return image
