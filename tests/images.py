"""Test images: small, deterministic, distinct per seed, encoded in any format PIL writes."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def gradient_image(seed: int, size: tuple[int, int], image_format: str) -> bytes:
    """A colour gradient with noise, `size` = (width, height), encoded as PNG, JPEG, WEBP, GIF, ..."""
    width, height = size
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, width)[None, :, None] * rng.uniform(0, 255, 3)
    pixels = np.clip(ramp + rng.normal(0, 40, (height, width, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=image_format)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"
