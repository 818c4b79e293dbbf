"""Content hashes of a sequence's full KV blocks, for prefix caching.

A block's K/V depend on every token before its end, on the adapter (LoRA on k/v changes them) and,
at image tokens, on the image itself (every image of a prompt has the same placeholder ids). So a
block's hash covers the previous block's hash, the adapter version (the content digest of its config
and weights, not its name: a name registered again with new weights is another adapter, and two
names for the same files are one), the block's token ids and, for its image tokens, (position, image
digest, feature index):

    block 0: sha256(b"", "3fa1...", [1, 306, 4458, 29871], ())
    block 1: sha256(hash 0, "3fa1...", [32000, 32000, 32000, 32000], ((4, "9c0e...", 0), ...))
"""

from __future__ import annotations

import hashlib

from gpu_worker.lora.loader import AdapterRef
from gpu_worker.sequence import Sequence


def adapter_key(adapter: AdapterRef | None) -> str:
    """The adapter as far as K/V are concerned: its version's digest."""
    if adapter is None:
        return ""
    assert adapter.sha256, f"adapter {adapter.name} has no digest"
    return adapter.sha256


def block_hash(seq: Sequence, index: int, block_size: int) -> bytes:
    """The hash of `seq`'s full block `index` (memoised in seq.block_hashes, with those before it)."""
    assert (index + 1) * block_size <= seq.num_tokens, (index, seq.num_tokens)
    hashes = seq.block_hashes
    while len(hashes) <= index:
        start, end = len(hashes) * block_size, (len(hashes) + 1) * block_size
        images = seq.images.content_in(start, end) if seq.images is not None else ()
        content = (hashes[-1] if hashes else b"", adapter_key(seq.adapter), seq.token_ids_in(start, end), images)
        hashes.append(hashlib.sha256(repr(content).encode()).digest())
    return hashes[index]
