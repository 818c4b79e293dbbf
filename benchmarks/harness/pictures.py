"""The pictures benchmark requests carry: distinct smooth random images, JPEG-encoded (what a client sends)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def jpeg(seed: int, size: tuple[int, int]) -> bytes:
    """A distinct smooth random picture of `size` (width, height), JPEG-encoded."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize(size, Image.BILINEAR)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()
