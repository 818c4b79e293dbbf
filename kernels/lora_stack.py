"""LoRAStack: one projection's tables of where each adapter slot's weights lie in the model's arena.

A projection has 1..3 output slices (fused qkv: q, k, v; fused gate_up: gate, up; others: one).
An adapter targets some of them, each with its own rank and scaling (PEFT's rank_pattern and
alpha_pattern). Its weights for this projection are one range of the model's AdapterArena
(kernels/adapter_arena.py), packed at their true ranks, slice after slice, each block starting
ALIGN-aligned:

    A_s  [r_s, in_features]  rows contiguous
    B_sᵀ [r_s, out_size_s]   rows contiguous (rank-major: a rank-r adapter's rows are dense)

Example, a fused qkv of in 4096 and out sizes (4096, 1024, 1024), an adapter targeting q at rank 16
(scaling 2.0) and v at rank 8 (scaling 0.5), packed at arena offset 1_048_576 and placed in slot 2:

    out_offsets  = (0, 4096, 5120, 6144)            slot_elems([16, 0, 8]) = 172_032
    a_offsets[2] = [1_048_576,          0, 1_179_648]    A_q 16 x 4096 at +0, A_v 8 x 4096 at +131_072
    b_offsets[2] = [1_114_112,          0, 1_212_416]    B_qᵀ 16 x 4096 at +65_536, B_vᵀ 8 x 1024 at +163_840
    ranks[2]     = [16, 0, 8]           scalings[2] = [2.0, 0.0, 0.5]

A slot costs only its table rows, so a stack may have many (1024); the arena holds what is loaded.
The kernels read A_s at arena[a_offsets[slot, s] + r * in_features + k] and B_sᵀ at
arena[b_offsets[slot, s] + r * out_size_s + column - out_offsets[s]]. The tables and the arena are
allocated once and only their contents change, so CUDA graphs replay over whatever is loaded.

Two ways in. A pool that owns the arena's budget allocates one range per adapter, `pack`s each
projection's part into a (pinned) host buffer at that projection's sub-offset, copies the buffer to
the arena in one memcpy, and `place`s each stack's slot there (stream-ordered: the tables are
written after the copy); after `arena.compact()` it `rebase`s the slots that moved. `set_slot` does
all of that inside this stack's arena for tests, benchmarks and a pool of fixed slots: it allocates
(compacting the arena when no hole fits), packs, places, and follows compactions itself;
`reset_slot` frees and clears.
"""

from __future__ import annotations

import array
import functools
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kernels.adapter_arena import ALIGN, AdapterArena, Moves, aligned
from kernels.batch import LoRABatch

Slices = Mapping[int, tuple[torch.Tensor, torch.Tensor]]  # slice -> (A [r, in_features], B [out_size, r])


def packed_layout(in_features: int, out_sizes: Sequence[int], slice_ranks: Sequence[int]
                  ) -> tuple[list[int], list[int], int]:
    """(offset of each slice's A, offset of its Bᵀ, elements of the whole range) of an adapter with
    these per-slice ranks, relative to the start of its range; untargeted slices (rank 0) get 0 and
    take no room."""
    a_rel, b_rel, cursor = [], [], 0
    for rank, out_size in zip(slice_ranks, out_sizes, strict=True):
        a_rel.append(cursor if rank else 0)
        cursor += aligned(rank * in_features)
        b_rel.append(cursor if rank else 0)
        cursor += aligned(rank * out_size)
    return a_rel, b_rel, cursor


def packed_elems(in_features: int, out_sizes: Sequence[int], slice_ranks: Sequence[int]) -> int:
    """Arena elements a projection of this shape needs for an adapter with these per-slice ranks."""
    return packed_layout(in_features, out_sizes, slice_ranks)[2]


@dataclass(eq=False)  # holds tensors: identity, not value, equality
class LoRAStack:
    arena: AdapterArena            # the model's adapter memory, shared by every stack
    a_offsets: torch.Tensor        # int64 [num_slots, num_slices] arena offset of A_s; 0 where the rank is 0
    b_offsets: torch.Tensor        # int64 [num_slots, num_slices] arena offset of B_sᵀ; 0 where the rank is 0
    ranks: torch.Tensor            # int32 [num_slots, num_slices]; 0: empty slot or slice not targeted
    scalings: torch.Tensor         # float32 [num_slots, num_slices] alpha_s / r_s
    in_features: int
    out_offsets: tuple[int, ...]   # [num_slices + 1] host; last == out_features
    max_rank: int                  # the serving bound on any slice's rank: y's width, tiling's rank bound
    host_a_offsets: list[list[int]]      # [num_slots][num_slices] host mirrors of the tables
    host_b_offsets: list[list[int]]
    host_ranks: list[list[int]]
    host_scalings: list[list[float]]     # float32 values
    owned: dict[int, int] = field(default_factory=dict)  # slot -> arena offset set_slot allocated for it

    def __post_init__(self) -> None:
        num_slots, num_slices = self.ranks.shape
        for table, dtype in ((self.a_offsets, torch.int64), (self.b_offsets, torch.int64),
                             (self.ranks, torch.int32), (self.scalings, torch.float32)):
            assert table.shape == (num_slots, num_slices) and table.dtype == dtype and table.is_contiguous(), (
                table.shape, table.dtype)
            assert table.device == self.arena.device, (table.device, self.arena.device)
        assert len(self.out_offsets) == num_slices + 1 and self.out_offsets[0] == 0
        assert self.in_features > 0 and self.max_rank > 0, (self.in_features, self.max_rank)
        for mirror in (self.host_a_offsets, self.host_b_offsets, self.host_ranks, self.host_scalings):
            assert len(mirror) == num_slots and all(len(row) == num_slices for row in mirror)

    # Cached: the tables' shapes never change, and an install reads these for each of ~100 stacks.
    @functools.cached_property
    def num_slots(self) -> int:
        return self.ranks.shape[0]

    @functools.cached_property
    def num_slices(self) -> int:
        return self.ranks.shape[1]

    @property
    def out_features(self) -> int:
        return self.out_offsets[-1]

    @functools.cached_property
    def out_sizes(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in zip(self.out_offsets, self.out_offsets[1:]))

    @property
    def dtype(self) -> torch.dtype:
        return self.arena.dtype

    @property
    def device(self) -> torch.device:
        return self.arena.device

    @staticmethod
    def empty(num_slots: int, in_features: int, out_sizes: Sequence[int], max_rank: int,
              arena: AdapterArena) -> LoRAStack:
        """All slots empty (rank 0 everywhere); `out_sizes` are the slices' output widths."""
        assert num_slots > 0 and len(out_sizes) > 0 and all(n > 0 for n in out_sizes), (num_slots, out_sizes)
        shape, device = (num_slots, len(out_sizes)), arena.device
        stack = LoRAStack(
            arena=arena,
            a_offsets=torch.zeros(shape, dtype=torch.int64, device=device),
            b_offsets=torch.zeros(shape, dtype=torch.int64, device=device),
            ranks=torch.zeros(shape, dtype=torch.int32, device=device),
            scalings=torch.zeros(shape, dtype=torch.float32, device=device),
            in_features=in_features, out_offsets=(0, *itertools.accumulate(out_sizes)), max_rank=max_rank,
            host_a_offsets=[[0] * shape[1] for _ in range(num_slots)],
            host_b_offsets=[[0] * shape[1] for _ in range(num_slots)],
            host_ranks=[[0] * shape[1] for _ in range(num_slots)],
            host_scalings=[[0.0] * shape[1] for _ in range(num_slots)],
        )
        arena.on_compact(stack._follow)
        return stack

    @staticmethod
    def standalone(num_slots: int, in_features: int, out_sizes: Sequence[int], max_rank: int,
                   dtype: torch.dtype, device: torch.device | str) -> LoRAStack:
        """An empty stack with an arena of its own, room for `num_slots` adapters of max_rank on every
        slice (tests, benchmarks, the tuner)."""
        elems = num_slots * packed_elems(in_features, out_sizes, [max_rank] * len(out_sizes))
        return LoRAStack.empty(num_slots, in_features, out_sizes, max_rank, AdapterArena(elems, dtype, device))

    # ---- packing and placing -----------------------------------------------------------------

    def slot_elems(self, slice_ranks: Sequence[int]) -> int:
        """Arena elements this projection needs for an adapter with these per-slice ranks (0: not targeted)."""
        return packed_elems(self.in_features, self.out_sizes, slice_ranks)

    def ranks_of(self, slices: Slices) -> list[int]:
        """The rank of each slice (0: absent from `slices`); ValueError when the weights do not fit
        this projection."""
        ranks = [0] * self.num_slices
        for s, (a, b) in slices.items():
            if not 0 <= s < self.num_slices:
                raise ValueError(f"slice {s} out of range: this projection has {self.num_slices} slices")
            rank, out_size = a.shape[0], self.out_sizes[s]
            if a.shape != (rank, self.in_features) or b.shape != (out_size, rank):
                raise ValueError(f"slice {s}: expected A {(rank, self.in_features)} and B {(out_size, rank)}, "
                                 f"got A {tuple(a.shape)} and B {tuple(b.shape)}")
            if rank > self.max_rank:
                raise ValueError(f"slice {s}: adapter rank {rank} exceeds this projection's max LoRA rank "
                                 f"{self.max_rank}; raise the serving max rank or use an adapter of rank <= "
                                 f"{self.max_rank}")
            ranks[s] = rank
        return ranks

    def pack(self, slices: Slices, dest: torch.Tensor) -> None:
        """Write the adapter's weights for this projection into the flat buffer `dest` (any device,
        at least slot_elems of them) in the arena's layout; gaps between blocks are left as they are."""
        ranks = self.ranks_of(slices)
        a_rel, b_rel, elems = packed_layout(self.in_features, self.out_sizes, ranks)
        assert dest.dim() == 1 and dest.numel() >= elems, (dest.shape, elems)
        for s, (a, b) in slices.items():
            rank = ranks[s]
            dest[a_rel[s]:a_rel[s] + rank * self.in_features].view(rank, self.in_features).copy_(a)
            dest[b_rel[s]:b_rel[s] + rank * self.out_sizes[s]].view(rank, self.out_sizes[s]).copy_(b.t())

    def place(self, slot: int, offset: int, slice_ranks: Sequence[int], slice_scalings: Sequence[float],
              upload: bool = True) -> None:
        """Point `slot` at the adapter packed at arena[offset:] (there now, or copied there earlier on this
        stream). The device tables are written with non-blocking copies on the current stream; with
        `upload` False only the host mirrors change, and `upload_rows` writes many stacks' rows at once."""
        self.place_many([slot], [offset], [slice_ranks], [slice_scalings], upload)

    def place_many(self, slots: Sequence[int], offsets: Sequence[int], slice_ranks: Sequence[Sequence[int]],
                   slice_scalings: Sequence[Sequence[float]], upload: bool = True) -> None:
        """`place` for many slots in one table update (benchmarks and the tuner fill thousands)."""
        assert len(set(slots)) == len(slots) == len(offsets) == len(slice_ranks) == len(slice_scalings)
        for slot, offset, ranks, scalings in zip(slots, offsets, slice_ranks, slice_scalings):
            scalings = array.array("f", scalings).tolist()  # as the float32 table will hold them
            self._check_slot(slot)
            assert slot not in self.owned, f"slot {slot} holds an adapter set_slot loaded: reset_slot first"
            assert offset % ALIGN == 0 and len(ranks) == len(scalings) == self.num_slices, (offset, ranks, scalings)
            assert all(0 <= r <= self.max_rank for r in ranks), (ranks, self.max_rank)
            a_rel, b_rel, elems = packed_layout(self.in_features, self.out_sizes, ranks)
            assert offset + elems <= self.arena.capacity, (offset, elems, self.arena.capacity)
            self.host_a_offsets[slot] = [offset + rel if r else 0 for rel, r in zip(a_rel, ranks)]
            self.host_b_offsets[slot] = [offset + rel if r else 0 for rel, r in zip(b_rel, ranks)]
            self.host_ranks[slot] = list(ranks)
            self.host_scalings[slot] = [s if r else 0.0 for s, r in zip(scalings, ranks)]
        if upload:
            self._upload(slots)

    def clear(self, slot: int, upload: bool = True) -> None:
        """Empty `slot`'s tables (rank 0): its weights are no longer read. The arena range is the caller's.
        `upload`: as for `place`."""
        self._check_slot(slot)
        zeros = [0] * self.num_slices
        self.host_a_offsets[slot], self.host_b_offsets[slot], self.host_ranks[slot] = zeros, list(zeros), list(zeros)
        self.host_scalings[slot] = [0.0] * self.num_slices
        if upload:
            self._upload([slot])

    def mirror(self, source: int, slot: int, scale: float, upload: bool = True) -> None:
        """Point `slot` at `source`'s adapter with its scalings times `scale` (mixture mode reads the merged
        adapter's weights negated this way: no copy of them). `upload`: as for `place`."""
        self._check_slot(source)
        self._check_slot(slot)
        assert slot not in self.owned, f"slot {slot} holds an adapter set_slot loaded: reset_slot first"
        self.host_a_offsets[slot] = list(self.host_a_offsets[source])
        self.host_b_offsets[slot] = list(self.host_b_offsets[source])
        self.host_ranks[slot] = list(self.host_ranks[source])
        self.host_scalings[slot] = array.array("f", [s * scale for s in self.host_scalings[source]]).tolist()
        if upload:
            self._upload([slot])

    def rebase(self, slot: int, delta: int) -> None:
        """The adapter in `slot` moved by `delta` elements in the arena (a compaction): follow it."""
        self._shift(slot, delta)
        self._upload([slot])

    # ---- the convenience path: allocate, pack and place in this stack's arena -------------------

    def set_slot(self, slot: int, slices: Slices, scaling: float | Mapping[int, float]) -> None:
        """Load one adapter into `slot`: slices maps slice index -> (A [r_s, in_features], B [out_size, r_s]);
        `scaling` is one for every slice, or a mapping slice -> scaling covering every targeted slice. Slices
        absent from `slices` are not targeted. Whatever the slot held is freed first."""
        ranks = self.ranks_of(slices)  # checked before anything changes
        scalings = dict(scaling) if isinstance(scaling, Mapping) else {s: float(scaling) for s in slices}
        if not set(slices) <= set(scalings):
            raise ValueError(f"no scaling for slices {sorted(set(slices) - set(scalings))}")
        self.reset_slot(slot)
        elems = self.slot_elems(ranks)
        if elems == 0:
            return
        offset = self.arena.alloc(elems)
        if offset is None:  # holes too small: close them, every stack of the arena following
            self._compact_arena()
            offset = self.arena.alloc(elems)
        if offset is None:
            raise MemoryError(f"adapter arena full: {elems} elements needed, {self.arena.free_elems} of "
                              f"{self.arena.capacity} free")
        self.pack(slices, self.arena.data[offset:offset + elems])
        self.place(slot, offset, ranks, [scalings.get(s, 0.0) for s in range(self.num_slices)])
        self.owned[slot] = offset

    def reset_slot(self, slot: int) -> None:
        """Empty `slot`, and free the arena range set_slot allocated for it."""
        if slot in self.owned:
            self.arena.free(self.owned.pop(slot))
        self.clear(slot)

    def copy(self, dtype: torch.dtype, device: torch.device | str, num_slots: int | None = None) -> LoRAStack:
        """Slots 0..num_slots-1 (default: all) as a new stack in `dtype` on `device`, with an arena of just
        their size: float32 references of a 16-bit stack, a CPU-built stack moved to a GPU."""
        num_slots = self.num_slots if num_slots is None else num_slots
        elems = sum(self.slot_elems(self.host_ranks[slot]) for slot in range(num_slots))
        copy = LoRAStack.empty(num_slots, self.in_features, self.out_sizes, self.max_rank,
                               AdapterArena(elems, dtype, device))
        for slot in range(num_slots):
            if any(self.host_ranks[slot]):
                copy.set_slot(slot, self.slot_weights(slot), dict(enumerate(self.host_scalings[slot])))
        return copy

    # ---- reading -----------------------------------------------------------------------------

    def a_weight(self, slot: int, s: int) -> torch.Tensor:
        """A_s of the adapter in `slot`: a [rank, in_features] view of the arena (host mirrors)."""
        rank, offset = self.host_ranks[slot][s], self.host_a_offsets[slot][s]
        return self.arena.data[offset:offset + rank * self.in_features].view(rank, self.in_features)

    def b_weight(self, slot: int, s: int) -> torch.Tensor:
        """B_sᵀ of the adapter in `slot`: a [rank, out_size_s] view of the arena (host mirrors)."""
        rank, offset, out_size = self.host_ranks[slot][s], self.host_b_offsets[slot][s], self.out_sizes[s]
        return self.arena.data[offset:offset + rank * out_size].view(rank, out_size)

    def slot_weights(self, slot: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The adapter in `slot` as set_slot takes it: {slice: (A [r, in_features], B [out_size, r])}, views."""
        return {s: (self.a_weight(slot, s), self.b_weight(slot, s).t())
                for s, rank in enumerate(self.host_ranks[slot]) if rank}

    def check_shrink_args(self, x: torch.Tensor, batch: LoRABatch) -> None:
        """x: [num_tokens, in_features] on this stack's device."""
        assert x.dim() == 2 and x.shape == (batch.num_tokens, self.in_features), (x.shape, batch.num_tokens)
        assert x.device == self.device == batch.lens.device, (x.device, self.device, batch.lens.device)

    def check_expand_args(self, out: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        """out: [num_tokens, out_features]; y: [splits, num_tokens, num_slices, batch.y_ranks(max_rank)] from
        lora_shrink: float32, or one plane in the dtype of the stack that computed it."""
        assert out.dim() == 2 and out.shape == (batch.num_tokens, self.out_features), (out.shape, batch.num_tokens)
        assert out.is_floating_point(), out.dtype
        assert y.is_floating_point() and (y.dtype == torch.float32 or y.shape[0] == 1) and y.dim() == 4 and (
            y.shape[1:] == (batch.num_tokens, self.num_slices, batch.y_ranks(self.max_rank))), (y.dtype, y.shape)
        assert out.device == y.device == self.device == batch.lens.device, (out.device, y.device)

    # ---- internals ---------------------------------------------------------------------------

    def _compact_arena(self) -> None:
        """Compact with the device idle before and after: it moves other slots' adapters, which kernels
        launched on any stream may be reading, and kernels launched next must find them moved. Rare: only
        when freed holes are too small, and a pool that owns the arena's budget compacts on its own terms."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.arena.compact()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check_slot(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots, (slot, self.num_slots)

    def _shift(self, slot: int, delta: int) -> None:
        assert delta % ALIGN == 0, delta
        ranks = self.host_ranks[slot]
        self.host_a_offsets[slot] = [o + delta if r else 0 for o, r in zip(self.host_a_offsets[slot], ranks)]
        self.host_b_offsets[slot] = [o + delta if r else 0 for o, r in zip(self.host_b_offsets[slot], ranks)]

    def _follow(self, moves: Moves) -> None:
        """After a compaction of the arena: rebase the slots whose range set_slot allocated and that moved."""
        moved = [slot for slot, offset in self.owned.items() if offset in moves]
        for slot in moved:
            self._shift(slot, moves[self.owned[slot]] - self.owned[slot])
            self.owned[slot] = moves[self.owned[slot]]
        if moved:
            self._upload(moved)

    def _upload(self, slots: Sequence[int]) -> None:
        """Copy the host mirrors' rows of `slots` into the device tables: two host-to-device copies,
        non-blocking on the current stream, then scatters on the device."""
        k = self.num_slices
        ints = torch.tensor([[slot, *self.host_a_offsets[slot], *self.host_b_offsets[slot], *self.host_ranks[slot]]
                             for slot in slots], dtype=torch.int64)  # [n, 1 + 3 * num_slices]
        floats = torch.tensor([self.host_scalings[slot] for slot in slots], dtype=torch.float32)  # [n, num_slices]
        ints, floats = _to_device(ints, self.device), _to_device(floats, self.device)
        index = ints[:, 0]
        self.a_offsets.index_copy_(0, index, ints[:, 1:1 + k])
        self.b_offsets.index_copy_(0, index, ints[:, 1 + k:1 + 2 * k])
        self.ranks.index_copy_(0, index, ints[:, 1 + 2 * k:].to(torch.int32))
        self.scalings.index_copy_(0, index, floats)


def upload_rows(stacks: Sequence[LoRAStack], slot: int) -> None:
    """Write `slot`'s rows of every stack's device tables from their host mirrors (after `place` or
    `clear` with upload False): one staging copy per table dtype and one multi-tensor copy each, instead of
    a few launches per stack (an adapter of a 32-layer model touches 96 stacks). Non-blocking, on the
    current stream."""
    widths = [stack.num_slices for stack in stacks]

    def staged(rows: Iterable[list], dtype: torch.dtype) -> list[torch.Tensor]:
        """The rows, concatenated, on the device in one copy; -> a view of each row there."""
        flat = torch.tensor([value for row in rows for value in row], dtype=dtype)
        return list(_to_device(flat, stacks[0].device).split(widths * (flat.numel() // sum(widths))))

    offsets = staged(itertools.chain((s.host_a_offsets[slot] for s in stacks), (s.host_b_offsets[slot] for s in stacks)),
                     torch.int64)
    torch._foreach_copy_([s.a_offsets[slot] for s in stacks] + [s.b_offsets[slot] for s in stacks], offsets)
    torch._foreach_copy_([s.ranks[slot] for s in stacks], staged((s.host_ranks[slot] for s in stacks), torch.int32))
    torch._foreach_copy_([s.scalings[slot] for s in stacks],
                         staged((s.host_scalings[slot] for s in stacks), torch.float32))


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":  # pinned: the copy runs in stream order, without a host sync
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
