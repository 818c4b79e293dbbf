"""A prompt's images on their way into the language model.

The model's processor turns each image into pixel values, and the image's placeholder in the prompt
into as many image tokens as the vision encoder makes features for it (LLaVA-1.5 at 336 px: 576).
The encoder's features replace those tokens' embeddings in order: feature k goes to the prompt's
k-th image token. A prompt with two 4-token images:

    positions   0 1 2 3 4 5 6 7 8 9 10 11 12
    image tokens    2 3 4 5     8 9 10 11          token_runs ((2, 4), (8, 4))
    features        0 1 2 3     4 5 6  7

A prefill chunk over positions [5, 10) takes feature 3 at position 5 and features 4, 5 at 8, 9.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from PIL import Image

from services.errors import InvalidArgument


@dataclass(frozen=True)
class PromptImages:
    pixel_values: torch.Tensor                 # [num_images, channels, height, width] from the image processor
    token_runs: tuple[tuple[int, int], ...]    # (first position, length) of each run of consecutive image tokens
    digests: tuple[str, ...]                   # [num_images] sha256 of each image's encoded bytes

    def __post_init__(self) -> None:
        assert self.token_runs, "a prompt with images has image tokens"
        assert len(self.digests) == self.pixel_values.shape[0], (self.digests, self.pixel_values.shape)
        assert self.num_tokens % len(self.digests) == 0, "every image has as many tokens (LLaVA-1.5)"

    @property
    def tokens_per_image(self) -> int:
        return self.num_tokens // len(self.digests)

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
        per_image = self.tokens_per_image
        return tuple((position + i, self.digests[(feature + i) // per_image], (feature + i) % per_image)
                     for position, feature, count in self.rows_in(start, end) for i in range(count))


def image_token_runs(token_ids: list[int], image_token_id: int) -> tuple[tuple[int, int], ...]:
    """The runs of consecutive `image_token_id` in `token_ids`, as (first position, length)."""
    runs: list[tuple[int, int]] = []
    for position, token in enumerate(token_ids):
        if token != image_token_id:
            continue
        if runs and sum(runs[-1]) == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return tuple(runs)


class ImageEncoder(Protocol):
    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: [num_images, channels, height, width] -> [num_images, tokens_per_image, hidden]:
        the features that replace each image's tokens, in order."""


def decode_image(data: bytes, index: int) -> Image.Image:
    """Encoded image bytes (PNG, JPEG, WebP, ...) -> a decoded PIL image; InvalidArgument if they do not
    decode. `index` numbers the image in its request, for the message."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # decode now: a truncated file fails here, not inside the image processor
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidArgument(f"image {index} is not a decodable image ({exc})", param="messages") from exc
    return image
