"""AdapterArena: the GPU memory every adapter of a model lives in, one flat tensor, packed by true size.

Every LoRAStack of a model (one per projection) points into the same arena through its tables
(kernels/lora_stack.py), so adapters of different ranks and target sets share one budget in
elements, with no padding to the largest rank. The arena is allocated once and never reallocated:
CUDA graphs captured over it stay valid whatever is loaded, moved or freed.

The allocator is host-side: first fit over a free list sorted by offset, neighbours coalesced on
free. Every allocation is rounded up to ALIGN elements, so every offset is a multiple of ALIGN
(rows start 128-byte aligned for 16-bit dtypes, which the kernels' vector loads rely on).
Example, capacity 512:

    alloc(100) -> 0     (128 elements)      alloc(64) -> 128       alloc(200) -> 192 (256 elements)
    free(128)           free list: [128, 192) [448, 512)
    alloc(100) -> None  (no hole of 128)    compact() -> {192: 128}: free list [384, 512)

`compact` slides live allocations down to close the holes, copying on the device in stream order,
and tells owners where theirs went ({old offset: new offset}, moved ones only), so that they rebase
their tables; callbacks registered with `on_compact` are told too.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable

import torch

ALIGN = 64  # elements: every allocation's offset and size are multiples of this

Moves = dict[int, int]  # old offset -> new offset of the allocations a compaction moved


def aligned(num_elems: int) -> int:
    """`num_elems` rounded up to ALIGN."""
    return -(-num_elems // ALIGN) * ALIGN


class AdapterArena:
    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device | str) -> None:
        assert capacity >= 0, capacity
        self.capacity = capacity
        self.data = torch.zeros(capacity, dtype=dtype, device=device)  # [capacity], the only device storage
        self._live: dict[int, int] = {}                    # offset -> elements (aligned)
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []  # (offset, elements), sorted
        self._listeners: list[weakref.WeakMethod] = []  # of owners' methods taking Moves
        self.compactions = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def used_elems(self) -> int:
        return sum(self._live.values())

    @property
    def free_elems(self) -> int:
        """Free elements in all holes together (one allocation may still not fit: see `largest_free`)."""
        return self.capacity - self.used_elems

    @property
    def largest_free(self) -> int:
        return max((n for _, n in self._free), default=0)

    def allocated_elems(self, offset: int) -> int:
        """Elements of the live allocation at `offset` (its request rounded up to ALIGN)."""
        return self._live[offset]

    def alloc(self, num_elems: int) -> int | None:
        """Offset of a new range of `num_elems` elements (first fit), or None when no hole holds it."""
        assert num_elems > 0, num_elems
        size = aligned(num_elems)
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self._live[offset] = size
                return offset
        return None

    def free(self, offset: int) -> None:
        """Give back the allocation at `offset`, merged with the holes either side of it."""
        size = self._live.pop(offset)
        i = bisect.bisect(self._free, (offset, 0))
        if i < len(self._free) and self._free[i][0] == offset + size:  # the hole after it
            size += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == offset:  # the hole before it
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (offset, size))

    def on_compact(self, listener: Callable[[Moves], None]) -> None:
        """Call `listener(moves)` after every compaction (owners rebase what they placed). `listener` is
        a bound method, held weakly: an owner that is gone stops listening, and is not kept alive."""
        self._listeners.append(weakref.WeakMethod(listener))

    def compact(self) -> Moves:
        """Slide every live allocation down, in offset order, so that all free space is one hole at
        the end. Copies run on the current stream: kernels queued after this call read the moved
        data. A move onto a range that overlaps its source goes through a temporary copy."""
        self.compactions += 1
        moves: Moves = {}
        live: dict[int, int] = {}
        cursor = 0
        for offset in sorted(self._live):
            size = self._live[offset]
            if offset != cursor:
                source = self.data[offset:offset + size]
                if offset < cursor + size:  # overlapping ranges: copy_ would read what it has overwritten
                    source = source.clone()
                self.data[cursor:cursor + size].copy_(source)
                moves[offset] = cursor
            live[cursor] = size
            cursor += size
        self._live = live
        self._free = [(cursor, self.capacity - cursor)] if cursor < self.capacity else []
        self._listeners = [ref for ref in self._listeners if ref() is not None]
        for ref in self._listeners:
            ref()(moves)
        return moves
