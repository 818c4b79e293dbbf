"""AdapterArena's allocator: first fit, alignment, coalescing, fragmentation and compaction (CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.adapter_arena import ALIGN, AdapterArena


def arena(capacity: int = 16 * ALIGN) -> AdapterArena:
    return AdapterArena(capacity, torch.float32, "cpu")


def holes(a: AdapterArena) -> list[tuple[int, int]]:
    """The free ranges as (start, end), from the live allocations alone (not the allocator's list)."""
    ranges, cursor = [], 0
    for offset in sorted(a._live):
        if offset > cursor:
            ranges.append((cursor, offset))
        cursor = offset + a.allocated_elems(offset)
    return ranges + ([(cursor, a.capacity)] if cursor < a.capacity else [])


def test_allocations_are_aligned_first_fit_and_rounded_up():
    a = arena()
    assert a.alloc(1) == 0 and a.allocated_elems(0) == ALIGN
    assert a.alloc(ALIGN + 1) == ALIGN and a.allocated_elems(ALIGN) == 2 * ALIGN
    assert a.alloc(ALIGN) == 3 * ALIGN
    assert (a.used_elems, a.free_elems) == (4 * ALIGN, 12 * ALIGN)
    a.free(ALIGN)  # a hole of two blocks at ALIGN
    assert a.alloc(ALIGN) == ALIGN  # first fit: the hole, not the end
    assert a.alloc(ALIGN) == 2 * ALIGN
    assert a.alloc(ALIGN) == 4 * ALIGN


def test_a_fragmented_arena_refuses_what_fits_in_total_until_compacted():
    a = arena(8 * ALIGN)
    offsets = [a.alloc(ALIGN) for _ in range(8)]
    for offset in offsets[::2]:
        a.free(offset)  # four one-block holes
    assert a.free_elems == 4 * ALIGN and a.largest_free == ALIGN
    assert a.alloc(2 * ALIGN) is None and a.compactions == 0
    moves = a.compact()
    assert a.compactions == 1
    assert moves == {ALIGN: 0, 3 * ALIGN: ALIGN, 5 * ALIGN: 2 * ALIGN, 7 * ALIGN: 3 * ALIGN}
    assert a.largest_free == 4 * ALIGN and a.alloc(4 * ALIGN) == 4 * ALIGN
    assert a.alloc(1) is None


def test_free_coalesces_with_both_neighbours():
    a = arena(6 * ALIGN)
    x, y, z = a.alloc(ALIGN), a.alloc(2 * ALIGN), a.alloc(ALIGN)
    a.free(x)
    a.free(z)  # merges with the tail hole
    assert a._free == [(0, ALIGN), (3 * ALIGN, 3 * ALIGN)]
    a.free(y)  # merges with both
    assert a._free == [(0, 6 * ALIGN)]
    assert a.alloc(6 * ALIGN) == 0
    with pytest.raises(KeyError):
        a.free(ALIGN)  # not an allocation


def test_compaction_preserves_contents_including_overlapping_moves():
    """A 5-block allocation moved down by one block overlaps its own source."""
    a = arena(10 * ALIGN)
    small, big, tail = a.alloc(ALIGN), a.alloc(5 * ALIGN), a.alloc(2 * ALIGN)
    values = {big: torch.randn(5 * ALIGN), tail: torch.randn(2 * ALIGN)}
    for offset, v in values.items():
        a.data[offset:offset + v.numel()] = v
    a.free(small)
    heard = []

    class Owner:
        def follow(self, moves: dict[int, int]) -> None:
            heard.append(moves)

    owner = Owner()
    a.on_compact(owner.follow)
    moves = a.compact()
    assert moves == {big: 0, tail: 5 * ALIGN} and heard == [moves]
    for old, v in values.items():
        new = moves[old]
        assert torch.equal(a.data[new:new + v.numel()], v)
        assert a.allocated_elems(new) == v.numel()
    del owner  # held weakly: a listener that is gone is dropped, not called
    a.compact()
    assert heard == [moves]


def test_random_allocations_keep_the_allocator_exact():
    """Random allocs and frees (and compactions) against the live ranges: disjoint, aligned, inside the
    arena; the free list is exactly the holes between them, coalesced; contents survive compaction."""
    rng = random.Random(0)
    a = arena(64 * ALIGN)
    tags: dict[int, float] = {}  # offset -> the value its elements hold
    for step in range(2000):
        if tags and (rng.random() < 0.45 or a.largest_free < 8 * ALIGN):
            offset = rng.choice(sorted(tags))
            a.free(offset)
            del tags[offset]
        else:
            size = rng.randint(1, 8 * ALIGN)
            offset = a.alloc(size)
            if offset is None:
                assert a.largest_free < -(-size // ALIGN) * ALIGN
                continue
            assert offset % ALIGN == 0 and a.allocated_elems(offset) >= size
            tags[offset] = float(step)
            a.data[offset:offset + a.allocated_elems(offset)] = float(step)
        if step % 97 == 0:
            moves = a.compact()
            tags = {moves.get(offset, offset): tag for offset, tag in tags.items()}
            assert len(holes(a)) <= 1
        assert a._free == [(start, end - start) for start, end in holes(a)]
        assert a.used_elems + a.free_elems == a.capacity
    for offset, tag in tags.items():
        assert bool((a.data[offset:offset + a.allocated_elems(offset)] == tag).all())
