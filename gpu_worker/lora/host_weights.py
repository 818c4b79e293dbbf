"""The host tier's memory: one region page-locked once, at start, cut into fixed-size pages.

An adapter's host copy is packed exactly as it will lie in the GPU's adapter arena (kernels/lora_stack.py:
the layout) across whole pages, so that its GPU install is a DMA of its bytes (one copy per run of
consecutive pages), with nothing converted, hashed or gathered on the way.

Page-locking happens once because it stalls the GPU: `cudaHostRegister` (and a fresh `pin_memory()`)
holds up every other thread's kernel launches while it pins pages, and a load that registered its
own buffer raised the running streams' step p99 about 10x (docs/benchmarks/adapters.md). Fixed-size
pages leave no fragmentation to compact. With a `path`, the region is a file mapping there (in
/dev/shm: memory, not disk), private to this user, that the CPU LoRA workers map read-only: one copy
of every host adapter, read by all of them (services/common/cpu_lora/shm.py).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.cpu_lora.shm import create_mapping
from services.common.task_heads import TaskHead
from services.common.tower_lora import TowerLoraSpec

PAGE_BYTES = 2 << 20  # an adapter wastes at most one page minus its last block; 16 MB adapters none


def host_buffer(num_elems: int, dtype: torch.dtype, page_locked: bool, path: Path | None = None) -> torch.Tensor:
    """A zeroed 1-D host buffer; `page_locked`: registered with CUDA for asynchronous copies, and
    unregistered when the tensor is freed; `path`: a new file (0600) mapped shared, removed when the
    tensor is freed."""
    buffer = torch.zeros(num_elems, dtype=dtype) if path is None else _shared_file(path, num_elems, dtype)
    if page_locked and num_elems:
        cudart = torch.cuda.cudart()
        nbytes = num_elems * buffer.element_size()
        status = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        if int(status) != 0:
            raise MemoryError(f"cannot page-lock {nbytes} bytes of host memory (CUDA error {int(status)})")
        weakref.finalize(buffer.untyped_storage(), cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer


def _shared_file(path: Path, num_elems: int, dtype: torch.dtype) -> torch.Tensor:
    buffer = torch.frombuffer(create_mapping(path, num_elems * dtype.itemsize), dtype=dtype)
    weakref.finalize(buffer.untyped_storage(), path.unlink, missing_ok=True)
    return buffer


class HostPages:
    """`capacity_bytes` of host memory (rounded up to whole pages); any thread may take and give back pages."""

    def __init__(self, capacity_bytes: int, page_locked: bool, page_bytes: int = PAGE_BYTES,
                 path: Path | None = None) -> None:
        """`path`: hold the region in a new file there, for other processes to map (see the module doc)."""
        assert page_bytes > 0 and page_bytes % 128 == 0, page_bytes  # packed blocks are 128-byte aligned
        self.page_bytes = page_bytes
        self.path = path
        num_pages = self.pages_for(capacity_bytes)
        self._region = host_buffer(num_pages * page_bytes, torch.uint8, page_locked, path)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first: runs stay long
        self._lock = threading.Lock()
        self.num_pages = num_pages

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def region(self) -> torch.Tensor:
        """The whole region (uint8): page p is bytes [p * page_bytes, (p + 1) * page_bytes)."""
        return self._region

    def close(self) -> None:
        """Remove the region's file, if it has one (its memory goes with the last mapping of it)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    @property
    def free_pages(self) -> int:
        with self._lock:
            return len(self._free)

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_bytes)

    def rounded(self, nbytes: int) -> int:
        """`nbytes` in whole pages: what it holds of the host tier."""
        return self.pages_for(nbytes) * self.page_bytes

    def take(self, nbytes: int) -> tuple[int, ...]:
        """Pages for `nbytes`, sorted; MemoryError when too few are free (the tiers' budget should prevent it)."""
        needed = self.pages_for(nbytes)
        with self._lock:
            if needed > len(self._free):
                raise MemoryError(f"host tier: {needed} pages of {self.page_bytes} bytes needed, "
                                  f"{len(self._free)} free")
            return tuple(sorted(self._free.pop() for _ in range(needed)))

    def give_back(self, pages: tuple[int, ...]) -> None:
        with self._lock:
            self._free.extend(pages)
            self._free.sort(reverse=True)

    def runs(self, pages: tuple[int, ...], nbytes: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(byte offset within the copy, region view) for each run of consecutive `pages`, covering `nbytes`."""
        start = 0
        while start < len(pages):
            end = start + 1
            while end < len(pages) and pages[end] == pages[end - 1] + 1:
                end += 1
            first, at = start * self.page_bytes, pages[start] * self.page_bytes
            yield first, self._region[at:at + min(nbytes, end * self.page_bytes) - first]
            start = end


@dataclass(frozen=True)
class PackedExtras:
    """What follows the LoRA parts in an adapter's packed copy, tensor after tensor: its task head's (by the
    head's names, "score.weight") and its tower LoRA's (by PEFT's names). They move with the adapter through
    the tiers and are read in place."""
    head: TaskHead | None
    tower: TowerLoraSpec | None
    tensors: tuple[tuple[str, int, tuple[int, ...]], ...]  # (name, element offset in the copy, shape)


@dataclass(frozen=True, eq=False)  # holds pages: identity, not value, equality
class PackedAdapter:
    name: str
    rank: int             # the largest of its slices' ranks (what the scheduler batches by)
    dtype: torch.dtype
    nbytes: int           # its packed bytes (what the GPU arena takes)
    pages: tuple[int, ...]  # its host pages, in order; returned to the pool when this is freed
    parts: tuple[tuple[int, tuple[int, ...], tuple[float, ...]], ...]  # per projection of GpuAdapterMemory's
    #                     order: (element offset in the copy, each slice's rank, each slice's scaling); rank 0: untargeted
    pool: HostPages = field(repr=False)
    extras: PackedExtras | None = None  # its task head and tower LoRA, if it has either

    def __post_init__(self) -> None:
        weakref.finalize(self, self.pool.give_back, self.pages)

    @property
    def host_bytes(self) -> int:
        """What it holds of the host tier: whole pages."""
        return len(self.pages) * self.pool.page_bytes
