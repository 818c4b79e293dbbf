"""Image-embedding cache: identical images reuse their encoder output across requests and steps.

An image is known by the sha256 of its encoded bytes (PromptImages.digests; a video by its frames and
grid); the worker serves one model, so the digest decides the base tower's features. An adapter with LoRA
on the vision tower (services/common/tower_lora.py) changes them: its entries are keyed by its content
digest too (AdapterRef.sha256), so a name registered again with new weights never meets the old
features, while every adapter without tower LoRA shares the base features. Entries are the projected
features of one image, [its image tokens, hidden] on the model's device, kept in LRU order within a
byte budget.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from gpu_worker.lora.loader import TowerWeights
from gpu_worker.vision.images import EncoderImage, ImageEncoder, PromptImages

FeatureKey = tuple[str, str]  # (image digest, the tower adapter's content digest or "" for the base tower)


class ImageFeatureCache:
    """LRU of FeatureKey -> features, bounded by `max_bytes` (0: nothing is kept)."""

    def __init__(self, max_bytes: int) -> None:
        assert max_bytes >= 0, max_bytes
        self.max_bytes = max_bytes
        self.hits = 0       # lookups that found the features (totals since start, for the worker's stats)
        self.misses = 0
        self.evictions = 0  # entries dropped to make room
        self._bytes = 0
        self._entries: OrderedDict[FeatureKey, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def get(self, key: FeatureKey) -> torch.Tensor | None:
        features = self._entries.get(key)
        if features is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return features

    def put(self, key: FeatureKey, features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        if size > self.max_bytes or key in self._entries:
            return
        while self._bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.numel() * evicted.element_size()
            self.evictions += 1
        self._entries[key] = features.clone()  # own memory: not a view keeping a whole batch alive
        self._bytes += size


@dataclass(frozen=True)
class TowerAdapter:
    """The tower LoRA a prompt's images go through: none (digest "") or its adapter's."""
    digest: str = ""                  # the adapter's content digest (AdapterRef.sha256) when it has tower LoRA
    tower: TowerWeights | None = None

    def __post_init__(self) -> None:
        assert bool(self.digest) == (self.tower is not None), self.digest


BASE_TOWER = TowerAdapter()


class CachedImageEncoder:
    """Prompts' features with only the images the cache lacks going through the encoder, all in one pass."""

    def __init__(self, encoder: ImageEncoder, cache: ImageFeatureCache) -> None:
        self.encoder = encoder
        self.cache = cache

    def __call__(self, prompts: list[tuple[PromptImages, TowerAdapter]]) -> list[torch.Tensor]:
        """-> each prompt's [images.num_tokens, hidden]: every image's features, in prompt order. An image
        missing from the cache is encoded once however many prompts of the step show it."""
        found: dict[FeatureKey, torch.Tensor] = {}
        missing: dict[FeatureKey, EncoderImage] = {}
        for images, adapter in prompts:
            for i, digest in enumerate(images.digests):
                key = (digest, adapter.digest)
                if key in found or key in missing:
                    continue
                features = self.cache.get(key)
                if features is not None:
                    found[key] = features
                else:
                    grid = images.grids[i] if images.grids is not None else None
                    missing[key] = EncoderImage(images.pixel_values[i], grid, adapter.tower)
        if missing:
            for key, features in zip(missing, self.encoder.encode(list(missing.values()))):
                found[key] = features
                self.cache.put(key, features)
        out = []
        for images, adapter in prompts:
            features = torch.cat([found[(digest, adapter.digest)] for digest in images.digests])
            assert features.shape[0] == images.num_tokens, (features.shape, images)
            out.append(features)
        return out
