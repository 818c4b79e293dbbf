"""Qwen2-VL's video pixels, as transformers' Qwen2VLVideoProcessor makes them (which needs torchvision):

    1. resize every frame to smart_resize(h, w) (multiples of patch * merge, within min..max pixels),
       bicubic with antialiasing on the uint8 frames (what torchvision's resize does on CPU)
    2. normalize in float32: (x - mean / rescale) / (std / rescale), the processor's fused rescale
    3. an odd frame count gets its last frame repeated (temporal_patch_size 2 pairs frames)
    4. patchify: [t * h * w, channels * temporal_patch * patch * patch], rows in merge x merge blocks

A 4-frame 56 x 56 video on the tiny test model (8 px patches, merge 2, 256..2304 pixels): resized to
48 x 48, grid (2, 6, 6), 72 patch rows, 18 video tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F
# The video processor's smart_resize, from the module that imports no torchvision.
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

CONFIG_FILES = ("video_preprocessor_config.json", "preprocessor_config.json")  # transformers' order


@dataclass(frozen=True)
class VideoProcessing:
    """The checkpoint's video processor settings (Qwen2VLVideoProcessor's defaults where it says none)."""
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 28 * 28 * 768
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_pretrained(cls, directory: Path) -> VideoProcessing:
        """The first of CONFIG_FILES present, as AutoVideoProcessor reads it (min/max_pixels override size)."""
        path = next((directory / name for name in CONFIG_FILES if (directory / name).is_file()), None)
        config = json.loads(path.read_text()) if path else {}
        size = config.get("size") or {}
        fields = {"min_pixels": config.get("min_pixels", size.get("shortest_edge")),
                  "max_pixels": config.get("max_pixels", size.get("longest_edge")),
                  **{name: config.get(name) for name in ("patch_size", "temporal_patch_size", "merge_size",
                                                         "rescale_factor")},
                  "image_mean": tuple(config["image_mean"]) if "image_mean" in config else None,
                  "image_std": tuple(config["image_std"]) if "image_std" in config else None}
        return cls(**{name: value for name, value in fields.items() if value is not None})

    def __call__(self, frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """frames uint8 [n, height, width, 3] -> (pixel values [t * h * w, 3 * temporal * patch^2] float32,
        grid (t, h, w))."""
        height, width = smart_resize(frames.shape[1], frames.shape[2], factor=self.patch_size * self.merge_size,
                                     min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        video = frames.permute(0, 3, 1, 2).contiguous()  # [n, 3, H, W]
        if (height, width) != video.shape[-2:]:
            video = F.interpolate(video, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
        mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)
        std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
        video = video.to(torch.float32).sub_(mean[:, None, None]).div_(std[:, None, None])
        if pad := -video.shape[0] % self.temporal_patch_size:
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        return self._patchify(video)

    def _patchify(self, video: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        frames, channels, height, width = video.shape
        patch, merge, temporal = self.patch_size, self.merge_size, self.temporal_patch_size
        t, h, w = frames // temporal, height // patch, width // patch
        patches = video.view(t, temporal, channels, h // merge, merge, patch, w // merge, merge, patch)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, h-block, w-block, h-in, w-in, c, temporal, py, px
        return patches.reshape(t * h * w, channels * temporal * patch * patch), (t, h, w)
