"""Image-embedding cache: identical images reuse their encoder output across requests.

An image is known by the sha256 of its encoded bytes (PromptImages.digests); the worker serves one
model, so the digest alone decides the features. Entries are the projected features of one image,
[its image tokens, hidden] on the model's device, kept in LRU order within a byte budget.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from gpu_worker.vision.images import ImageEncoder, PromptImages


class ImageFeatureCache:
    """LRU of digest -> features, bounded by `max_bytes` (0: nothing is kept)."""

    def __init__(self, max_bytes: int) -> None:
        assert max_bytes >= 0, max_bytes
        self.max_bytes = max_bytes
        self.hits = 0       # lookups that found the features (totals since start, for the worker's stats)
        self.misses = 0
        self.evictions = 0  # entries dropped to make room
        self._bytes = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def get(self, digest: str) -> torch.Tensor | None:
        features = self._entries.get(digest)
        if features is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(digest)
        return features

    def put(self, digest: str, features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        if size > self.max_bytes or digest in self._entries:
            return
        while self._bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.numel() * evicted.element_size()
            self.evictions += 1
        self._entries[digest] = features.clone()  # own memory: not a view keeping a whole batch alive
        self._bytes += size


class CachedImageEncoder:
    """A prompt's features with only the images the cache lacks going through the encoder (at once)."""

    def __init__(self, encoder: ImageEncoder, cache: ImageFeatureCache) -> None:
        self.encoder = encoder
        self.cache = cache

    def __call__(self, images: PromptImages) -> torch.Tensor:
        """-> [images.num_tokens, hidden]: every image's features, in prompt order."""
        found = [self.cache.get(digest) for digest in images.digests]
        missing = [i for i, features in enumerate(found) if features is None]
        if missing:
            encoded = self.encoder.encode(images, missing)  # [len(missing)] of [its image tokens, hidden]
            for i, features in zip(missing, encoded):
                found[i] = features
                self.cache.put(images.digests[i], features)
        features = torch.cat(found)
        assert features.shape[0] == images.num_tokens, (features.shape, images)
        return features
