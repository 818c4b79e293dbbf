"""Qwen2-VL's multimodal rotary positions (M-RoPE), as transformers' Qwen2VLModel.get_rope_index and
Qwen2VLRotaryEmbedding compute them.

Every token has three positions (temporal, height, width). Text tokens have three equal positions,
counting on from the previous token; an image's tokens (its merged patches, row-major over an h x w
grid) have (start, start + row, start + column), and the text after it continues at
start + max(h, w). A prompt of 2 text tokens, a 2 x 3 image and 1 text token:

    temporal  0 1  2 2 2 2 2 2  5
    height    0 1  2 2 2 3 3 3  5
    width     0 1  2 3 4 2 3 4  5          rope delta = max position + 1 - prompt length = 6 - 9 = -3

A video is t x h x w merged patches (t: one per 2 frames): its tokens, frame pair by frame pair, have
(start + time, start + row, start + column), and the text after it still continues at start + max(h, w),
not past its last time position: what transformers' get_rope_index (5.x) computes, which the rope delta
(from the largest position) follows.

Generated token i (0-based position p = prompt length + i) has p + rope delta in all three, so
decode steps rotate like plain RoPE. The head dimension's frequencies are split into mrope_section
(temporal, height, width) parts; part k rotates by position k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from gpu_worker.layers.rotary import RotaryEmbedding


def rope_index(num_tokens: int, image_runs: tuple[tuple[int, int], ...],
               grids: list[tuple[int, int, int]], merge: int) -> tuple[list[list[int]], int]:
    """A prompt's 3-D positions [3][num_tokens] and its rope delta. image_runs: (first position,
    length) of each image's or video's tokens, in order; grids: each one's (t, h, w) in patches before
    the merge x merge patch merger."""
    assert len(image_runs) == len(grids), (image_runs, grids)
    rows: list[list[int]] = [[], [], []]
    current, cursor = 0, 0

    def text(count: int) -> None:
        nonlocal current
        for row in rows:
            row.extend(range(current, current + count))
        current += count

    for (start, length), (t, h, w) in zip(image_runs, grids):
        h, w = h // merge, w // merge
        assert length == t * h * w, f"image at {start}: {length} tokens for a {t}x{h}x{w} grid"
        text(start - cursor)
        for ti in range(t):
            for hi in range(h):
                rows[0].extend([current + ti] * w)
                rows[1].extend([current + hi] * w)
                rows[2].extend(range(current, current + w))
        current += max(h, w)
        cursor = start + length
    text(num_tokens - cursor)
    return rows, max(max(row) for row in rows) + 1 - num_tokens


@dataclass(frozen=True)
class MRopePositions:
    """A prompt's M-RoPE positions (rope_index) and where its image tokens lie: the three rows differ
    only there, so a range of tokens outside it rotates like plain RoPE by its first row."""
    rows: tuple[tuple[int, ...], ...]   # [3][prompt length]
    delta: int                          # rope delta: the token at position p >= prompt length has p + delta
    image_span: tuple[int, int]         # [first, end) of the prompt's image tokens

    def positions_in(self, start: int, end: int) -> list[int] | list[list[int]]:
        """Rotary positions of tokens [start, end) of the prompt and then its outputs: [3][end - start]
        where the range reaches an image token, else [end - start] (decode steps: always)."""
        tail = list(range(max(start, len(self.rows[0])) + self.delta, end + self.delta))
        if start < self.image_span[1] and end > self.image_span[0]:
            return [list(row[start:end]) + tail for row in self.rows]
        return list(self.rows[0][start:end]) + tail


class MRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding over 3-D positions: positions [3, num_tokens], or [num_tokens] where all three
    are equal (decode steps, text-only prompts: then it is plain RoPE)."""

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__(config, head_dim)
        self.mrope_section = list(config.rope_parameters["mrope_section"])
        assert sum(self.mrope_section) == head_dim // 2, (self.mrope_section, head_dim)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, dtype)
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq   # [3, num_tokens, head_dim / 2]
        # frequency block k takes its angles from position k (temporal, height, width)
        freqs = torch.cat([part[k] for k, part in enumerate(freqs.split(self.mrope_section, dim=-1))], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)               # [num_tokens, head_dim]
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
