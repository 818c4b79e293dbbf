"""The paged KV cache's memory: per layer, K and V as [num_blocks, block_size, num_kv_heads, head_dim].

Which blocks belong to which sequence is the BlockManager's business; this module owns the
tensors and decides how many blocks fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def bytes_per_block(self, block_size: int) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * element


class PagedKVCache:
    def __init__(self, shape: CacheShape, num_blocks: int, block_size: int) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        size = (shape.num_layers, num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        self._k = torch.empty(size, dtype=shape.dtype, device=shape.device)
        self._v = torch.empty(size, dtype=shape.dtype, device=shape.device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V caches of one layer: [num_blocks, block_size, num_kv_heads, head_dim] each."""
        return self._k[index], self._v[index]


def cuda_blocks_that_fit(shape: CacheShape, block_size: int, memory_utilization: float, peak_bytes: int) -> int:
    """Blocks that fit in `memory_utilization` of the device, after `peak_bytes` (this process's
    peak: weights, adapter slots and a profiled forward pass at the largest batch) are set aside.

    The device may be shared: what other processes (or tensors of this one that outlive an earlier
    engine) hold is not in `peak_bytes`. A cache that would not fit beside them fails here, with
    the numbers, instead of as an out-of-memory error while it is allocated or at the first long
    batch."""
    free, total = torch.cuda.mem_get_info(shape.device)
    block_bytes = shape.bytes_per_block(block_size)
    available = int(total * memory_utilization) - peak_bytes
    blocks = available // block_bytes
    if blocks < 2:
        raise RuntimeError(f"no room for a KV cache: {available / 2**30:.2f} GiB left under "
                           f"gpu_memory_utilization={memory_utilization}")
    # Still to come beside the cache: the forward pass's activations, above what is allocated now.
    allocated = torch.cuda.memory_allocated(shape.device)
    activations = max(0, peak_bytes - allocated)
    if blocks * block_bytes + activations > free:
        reserved, gib = torch.cuda.memory_reserved(shape.device), 2**30
        raise RuntimeError(
            f"the KV cache does not fit: gpu_memory_utilization={memory_utilization} leaves "
            f"{blocks * block_bytes / gib:.2f} GiB for it and {activations / gib:.2f} GiB for activations, but "
            f"{free / gib:.2f} GiB of the device's {total / gib:.2f} GiB are free (this process holds "
            f"{reserved / gib:.2f} GiB, {allocated / gib:.2f} GiB of it allocated; other processes and the CUDA "
            f"context {max(0, total - free - reserved) / gib:.2f} GiB). Lower gpu_memory_utilization or set "
            f"kv_cache_tokens")
    return int(blocks)
