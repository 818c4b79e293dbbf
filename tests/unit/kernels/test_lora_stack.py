"""LoRAStack's tables into the arena: the packed layout, set_slot / reset_slot, the pool's path
(pack into a host buffer, one copy, place; rebase after a compaction), and its checks."""

from __future__ import annotations

import pytest
import torch

from kernels import AdapterArena, LoRAStack, upload_rows
from kernels.adapter_arena import ALIGN
from kernels.lora_stack import packed_elems


def weights(rank: int, in_features: int, out_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rank, in_features), torch.randn(out_size, rank)


def assert_tables_mirror_host(stack: LoRAStack) -> None:
    assert stack.a_offsets.tolist() == stack.host_a_offsets and stack.b_offsets.tolist() == stack.host_b_offsets
    assert stack.ranks.tolist() == stack.host_ranks and stack.scalings.tolist() == stack.host_scalings


def test_set_slot_packs_each_slice_at_its_own_rank_in_the_documented_layout():
    """q at rank 3, v at rank 2, k untargeted: A_q, B_qᵀ, A_v, B_vᵀ, each block ALIGN-aligned, in one range."""
    stack = LoRAStack.standalone(2, 8, (6, 2, 2), 4, torch.float32, "cpu")
    (a_q, b_q), (a_v, b_v) = weights(3, 8, 6), weights(2, 8, 2)
    stack.set_slot(1, {0: (a_q, b_q), 2: (a_v, b_v)}, {0: 0.25, 2: 0.75})
    offset = stack.owned[1]
    assert stack.arena.allocated_elems(offset) == stack.slot_elems([3, 0, 2]) == 4 * ALIGN
    assert stack.host_a_offsets[1] == [offset, 0, offset + 2 * ALIGN]
    assert stack.host_b_offsets[1] == [offset + ALIGN, 0, offset + 3 * ALIGN]
    assert stack.host_ranks == [[0, 0, 0], [3, 0, 2]] and stack.host_scalings == [[0.0] * 3, [0.25, 0.0, 0.75]]
    data = stack.arena.data
    assert torch.equal(data[offset:offset + 24].view(3, 8), a_q)
    assert torch.equal(data[offset + ALIGN:offset + ALIGN + 18].view(3, 6), b_q.t())
    assert torch.equal(data[offset + 2 * ALIGN:offset + 2 * ALIGN + 16].view(2, 8), a_v)
    assert torch.equal(data[offset + 3 * ALIGN:offset + 3 * ALIGN + 4].view(2, 2), b_v.t())
    assert_tables_mirror_host(stack)
    assert {s: (a.tolist(), b.tolist()) for s, (a, b) in stack.slot_weights(1).items()} == {
        0: (a_q.tolist(), b_q.tolist()), 2: (a_v.tolist(), b_v.tolist())}


def test_set_slot_replaces_the_previous_adapter_and_reset_slot_frees_it():
    stack = LoRAStack.standalone(2, 8, (4, 4), 4, torch.float32, "cpu")
    stack.set_slot(0, {0: weights(4, 8, 4), 1: weights(4, 8, 4)}, 1.0)
    stack.set_slot(1, {1: weights(1, 8, 4)}, 1.0)
    a, b = weights(2, 8, 4)
    stack.set_slot(0, {1: (a, b)}, 0.5)
    assert stack.host_ranks == [[0, 2], [0, 1]] and stack.host_scalings[0] == [0.0, 0.5]
    assert stack.arena.used_elems == stack.slot_elems([0, 2]) + stack.slot_elems([0, 1])  # the rank-4 range is free
    assert torch.equal(stack.a_weight(0, 1), a) and torch.equal(stack.b_weight(0, 1), b.t())
    assert_tables_mirror_host(stack)

    stack.reset_slot(0)
    stack.reset_slot(1)
    assert stack.host_ranks == [[0, 0], [0, 0]] and stack.arena.used_elems == 0 and stack.owned == {}
    assert_tables_mirror_host(stack)


def test_set_slot_rejects_adapters_that_do_not_fit_and_leaves_the_slot_as_it_was():
    stack = LoRAStack.standalone(2, 8, (4, 4), 4, torch.float32, "cpu")
    stack.set_slot(0, {0: weights(2, 8, 4)}, 1.0)
    before = (stack.host_ranks[0], stack.arena.used_elems)
    with pytest.raises(ValueError, match="slice 1: adapter rank 8 exceeds this projection's max LoRA rank 4"):
        stack.set_slot(0, {0: weights(2, 8, 4), 1: weights(8, 8, 4)}, 1.0)
    with pytest.raises(ValueError, match="slice 2 out of range"):
        stack.set_slot(0, {2: weights(2, 8, 4)}, 1.0)
    with pytest.raises(ValueError, match="expected A"):
        stack.set_slot(0, {0: (torch.randn(2, 7), torch.randn(4, 2))}, 1.0)
    with pytest.raises(ValueError, match=r"no scaling for slices \[1\]"):
        stack.set_slot(0, {0: weights(2, 8, 4), 1: weights(3, 8, 4)}, {0: 1.0})
    assert (stack.host_ranks[0], stack.arena.used_elems) == before


def test_slices_of_one_adapter_may_have_different_ranks():
    stack = LoRAStack.standalone(1, 8, (4, 4), 4, torch.float32, "cpu")
    stack.set_slot(0, {0: weights(2, 8, 4), 1: weights(3, 8, 4)}, {0: 1.0, 1: 2.0})
    assert stack.host_ranks == [[2, 3]] and stack.host_scalings == [[1.0, 2.0]]


def test_slots_cost_only_table_rows():
    arena = AdapterArena(packed_elems(64, (64, 16), [8, 8]), torch.float16, "cpu")
    stack = LoRAStack.empty(1024, 64, (64, 16), 64, arena)  # max rank 64: the arena holds one rank-8 adapter
    stack.set_slot(1023, {0: weights(8, 64, 64), 1: weights(8, 64, 16)}, 1.0)
    assert stack.num_slots == 1024 and stack.arena.free_elems == 0
    with pytest.raises(MemoryError, match="adapter arena full"):
        stack.set_slot(7, {0: weights(1, 64, 64)}, 1.0)


def test_pool_path_packs_in_a_host_buffer_places_then_rebases_after_compaction():
    """Two projections of one adapter in one arena range: packed into one host buffer, copied in one
    go, placed; after a compaction moved the range, rebase points the tables at the moved data."""
    arena = AdapterArena(4096, torch.float32, "cpu")
    qkv, o = LoRAStack.empty(4, 16, (16, 8, 8), 8, arena), LoRAStack.empty(4, 16, (16,), 8, arena)
    qkv_slices, o_slices = {0: weights(8, 16, 16), 2: weights(4, 16, 8)}, {0: weights(2, 16, 16)}
    qkv_ranks, o_ranks = qkv.ranks_of(qkv_slices), o.ranks_of(o_slices)
    split = qkv.slot_elems(qkv_ranks)
    host = torch.empty(split + o.slot_elems(o_ranks))  # pinned on a GPU worker
    qkv.pack(qkv_slices, host[:split])
    o.pack(o_slices, host[split:])
    hole = arena.alloc(ALIGN)  # something before the adapter, freed below: the compaction moves it
    offset = arena.alloc(host.numel())
    arena.data[offset:offset + host.numel()] = host  # the one copy
    qkv.place(2, offset, qkv_ranks, [0.5, 0.0, 2.0])
    o.place(2, offset + split, o_ranks, [1.5])
    expected = {s: (a.clone(), b.clone()) for s, (a, b) in qkv.slot_weights(2).items()}
    assert {s: (a.tolist(), b.tolist()) for s, (a, b) in expected.items()} == {
        s: (a.tolist(), b.tolist()) for s, (a, b) in qkv_slices.items()}

    arena.free(hole)
    moves = arena.compact()
    assert moves == {offset: offset - ALIGN}
    for stack in (qkv, o):
        stack.rebase(2, moves[offset] - offset)
        assert_tables_mirror_host(stack)
    assert all(torch.equal(a, expected[s][0]) and torch.equal(b, expected[s][1])
               for s, (a, b) in qkv.slot_weights(2).items())
    assert torch.equal(o.a_weight(2, 0), o_slices[0][0]) and o.host_scalings[2] == [1.5]


def test_copy_converts_dtype_and_keeps_every_slot():
    stack = LoRAStack.standalone(3, 8, (4, 4), 4, torch.float16, "cpu")
    stack.set_slot(2, {1: tuple(w.half() for w in weights(3, 8, 4))}, 0.5)
    copy = stack.copy(torch.float32, "cpu")
    assert copy.dtype == torch.float32 and copy.host_ranks == stack.host_ranks
    assert copy.host_scalings == stack.host_scalings and copy.arena.capacity == stack.slot_elems([0, 3])
    assert torch.equal(copy.a_weight(2, 1), stack.a_weight(2, 1).float())
    assert torch.equal(copy.b_weight(2, 1), stack.b_weight(2, 1).float())


def test_upload_rows_writes_one_slot_of_many_stacks_as_place_would():
    """Stacks of 1 and 3 slices in one arena: rows placed (and cleared) without upload reach the device
    tables in one batched upload; other slots' rows are untouched."""
    arena = AdapterArena(64 * ALIGN, torch.float32, "cpu")
    one = LoRAStack.empty(3, 8, (6,), 4, arena)
    three = LoRAStack.empty(3, 8, (6, 2, 2), 4, arena)
    one.place(0, 0, [4], [0.5])  # another slot, uploaded as usual
    one.place(2, 8 * ALIGN, [2], [0.25], upload=False)
    three.place(2, 16 * ALIGN, [3, 0, 1], [1.5, 0.0, 2.5], upload=False)
    assert one.ranks[2].tolist() == [0] and three.ranks[2].tolist() == [0, 0, 0]  # not on the device yet
    upload_rows([one, three], 2)
    assert_tables_mirror_host(one)
    assert_tables_mirror_host(three)
    three.clear(2, upload=False)
    upload_rows([one, three], 2)
    assert three.ranks[2].tolist() == [0, 0, 0] and one.ranks.tolist() == [[4], [0], [2]]
    assert_tables_mirror_host(three)
