"""The host tier's copy of an adapter: packed exactly as it will lie in the GPU's adapter arena, in
one buffer that is page-locked on a CUDA worker, so that the GPU install is ONE DMA of its bytes,
with nothing converted, hashed or gathered on the way (kernels/lora_stack.py: the layout).

The buffer is page-locked by registering ordinary memory with CUDA (cudaHostRegister) rather than
taken from torch's pinned allocator, which rounds every block up to a power of two and keeps freed
blocks: the host tier is budgeted in bytes, and a 640 MB adapter must not hold 1 GiB.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)  # holds a tensor: identity, not value, equality
class PackedAdapter:
    name: str
    rank: int             # the largest of its slices' ranks (what the scheduler batches by)
    buffer: torch.Tensor  # 1-D, the arena's dtype: every projection's part, at `parts`' offsets
    parts: tuple[tuple[int, tuple[int, ...], tuple[float, ...]], ...]  # per projection of GpuAdapterMemory's
    #                     order: (offset in the buffer, each slice's rank, each slice's scaling); rank 0: untargeted

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def host_buffer(num_elems: int, dtype: torch.dtype, page_locked: bool) -> torch.Tensor:
    """A zeroed 1-D host buffer; `page_locked`: registered with CUDA for asynchronous copies, and
    unregistered when the tensor is freed."""
    buffer = torch.zeros(num_elems, dtype=dtype)
    if page_locked and num_elems:
        cudart = torch.cuda.cudart()
        nbytes = num_elems * buffer.element_size()
        status = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        if int(status) != 0:
            raise MemoryError(f"cannot page-lock {nbytes} bytes of host memory for an adapter (CUDA error {int(status)})")
        weakref.finalize(buffer.untyped_storage(), cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer
