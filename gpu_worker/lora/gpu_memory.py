"""The GPU tier's storage: the model's adapter arena, packed by each adapter's true size.

Every adapter takes one range of the arena (kernels/adapter_arena.py), as many bytes as its ranks and
targets need (a rank-8 adapter about 1/8 of a rank-64 one), and one row of every projection's tables
(its slot; kernels/lora_stack.py). The loader packs an adapter on the host exactly as it will lie in
that range (`pack`, on a loader thread), so `install` is one copy of its bytes and a table update. A task
head's tensors and the tower LoRA's (a vision-language model's vision tower and projector) follow the LoRA
parts in the same range, one after another (host_weights.PackedExtras): they move with the adapter through
the tiers, and `head` and `tower` read them in place.

On CUDA, `install` writes the table rows, then copies on the caller's side stream, and returns the copy's
events (AdapterCopy): one after its last byte, and one after each group of projections' bytes, in
layer order. A step may take the adapter while the copy runs (layer-pipelined loading): each
projection's kernels wait on the device for that projection's own bytes (layer.py), so the copy of
later layers overlaps the compute of earlier ones. Other steps never wait for it.
An install writes only a free range and its own slot's rows, which no queued step reads (a slot is
freed only after its adapter's last request ended, and a request ends only once every step that ran
it has delivered its tokens), so the copy does not wait for the steps queued before it. The
exception is a compaction, when freed holes are too small for the next adapter: it moves resident
adapters that queued steps read, so it runs on the compute stream after every copy in flight, and
the install's copy then follows it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gpu_worker.lora.host_weights import HostPages, PackedAdapter, PackedExtras
from gpu_worker.lora.layer import LoRALinear
from gpu_worker.lora.loader import AdapterRef, HeadWeights, LoRAWeights, TowerWeights
from gpu_worker.lora.merge_switch import MergeSwitch
from kernels import AdapterArena, upload_rows
from kernels.adapter_arena import aligned

MIN_RANK_PER_SEAT = 8  # table rows: enough for the budget filled with adapters of this rank on every target
# An install's copy is cut into pieces of about this many bytes, an event after each: a few dozen copies for
# a 7B's adapter, each ahead of its layers' compute (one event per projection would cost launches, not time).
COPY_PIECE_BYTES = 2 << 20


@dataclass(frozen=True, eq=False)  # an identity: steps list the copies they wait for
class AdapterCopy:
    """An install's copy in flight: `done` after its last byte, `by_module` after each projection's."""
    done: torch.cuda.Event
    by_module: Mapping[LoRALinear, torch.cuda.Event]


def copy_waits(copies: list[AdapterCopy]) -> dict[LoRALinear, list[torch.cuda.Event]]:
    """For a step that runs adapters whose copies are in flight: each projection's events to wait for."""
    waits: dict[LoRALinear, list[torch.cuda.Event]] = {}
    for copy in copies:
        for module, event in copy.by_module.items():
            waits.setdefault(module, []).append(event)
    return waits


class GpuAdapterMemory:
    def __init__(self, layers: dict[tuple[int, str], tuple[LoRALinear, int]], arena: AdapterArena, max_rank: int,
                 merge_switch: MergeSwitch | None = None) -> None:
        """`layers`: (layer, PEFT target) -> (module, output slice), from the model, whose modules have
        their slots in `arena` already (LoRALinear.init_slots); `max_rank`: the largest rank served. The
        merge switch's mixture slot, if any, is the stacks' last and holds no adapter of its own."""
        self._layers = layers
        self._modules = list({id(module): module for module, _ in layers.values()}.values())
        assert all(m.lora is not None and m.lora.arena is arena for m in self._modules)
        self._stacks = [m.lora for m in self._modules]
        self.num_slots = self._modules[0].lora.num_slots - (merge_switch is not None)
        self._arena = arena
        self._itemsize = arena.data.element_size()
        self._served: dict[LoRALinear, set[int]] = {m: set() for m in self._modules}
        for module, out_slice in layers.values():
            self._served[module].add(out_slice)
        self.max_bytes = self.bytes_at_rank(max_rank)  # the largest servable adapter
        self.dtype = arena.dtype
        self.device = arena.device
        self._merge_switch = merge_switch
        self._offsets: dict[int, int] = {}  # slot -> its adapter's arena offset
        self._extras: dict[int, PackedExtras] = {}  # slot -> its adapter's task head and tower LoRA, if any

    @staticmethod
    def seats(budget_bytes: int, bytes_at_max_rank: int, max_rank: int) -> int:
        """Table rows for a budget: as many adapters as fit at rank MIN_RANK_PER_SEAT on every target."""
        return max(1, budget_bytes * max(1, max_rank // MIN_RANK_PER_SEAT) // bytes_at_max_rank)

    def bytes_at_rank(self, rank: int) -> int:
        """The most an adapter of `rank` occupies: that rank on every slice served."""
        return self._itemsize * sum(
            aligned(m.slot_elems([rank if s in self._served[m] else 0 for s in range(len(m.out_sizes))]))
            for m in self._modules)

    def bytes_of(self, ref: AdapterRef) -> int:
        """The most `ref` occupies, before its files are read: its rank on every slice, its head and tower LoRA."""
        head = 0 if ref.head is None else sum(math.prod(shape) for _, shape in ref.head.tensors)
        return self.bytes_at_rank(ref.rank) + aligned(head + ref.tower_lora_params) * self._itemsize

    def head(self, slot: int) -> HeadWeights | None:
        """The task head of `slot`'s adapter, as views of the arena (valid until the next install or free)."""
        extras = self._extras.get(slot)
        if extras is None or extras.head is None:
            return None
        return HeadWeights(extras.head, _views(extras, self._arena.data, self._offsets[slot],
                                               [name for name, _ in extras.head.tensors]))

    def tower(self, slot: int) -> TowerWeights | None:
        """The tower LoRA of `slot`'s adapter, as views of the arena (valid until the next install or free)."""
        extras = self._extras.get(slot)
        if extras is None or extras.tower is None:
            return None
        return TowerWeights(extras.tower, _views(extras, self._arena.data, self._offsets[slot],
                                                 [name for name, _ in extras.tower.tensors]))

    def host_tower(self, packed: PackedAdapter) -> TowerWeights | None:
        """The tower LoRA of a host copy (an adapter the CPU LoRA workers serve), its tensors alone copied to the
        device (not the whole copy: its LoRA parts stay with the CPU workers)."""
        extras = packed.extras
        if extras is None or extras.tower is None:
            return None
        names = [name for name, _ in extras.tower.tensors]
        where = {name: (at, math.prod(shape)) for name, at, shape in extras.tensors}
        first = min(where[name][0] for name in names)
        last = max(at + size for at, size in (where[name] for name in names))
        data = self._host_elements(packed, first, last).to(self.device)
        return TowerWeights(extras.tower, _views(extras, data, -first, names))

    def _host_elements(self, packed: PackedAdapter, first: int, last: int) -> torch.Tensor:
        """Elements [first, last) of a host copy, gathered from its runs of pages."""
        lo, hi = first * self._itemsize, last * self._itemsize
        pieces = [view[max(lo, start) - start:min(hi, start + view.numel()) - start]
                  for start, view in packed.pool.runs(packed.pages, packed.nbytes)
                  if max(lo, start) < min(hi, start + view.numel())]
        return torch.cat(pieces).view(self.dtype)

    @property
    def budget_bytes(self) -> int:
        return self._arena.capacity * self._itemsize

    @property
    def modules(self) -> list[LoRALinear]:
        """The adapted projections, in the order of a packed adapter's parts."""
        return list(self._modules)

    @property
    def compactions(self) -> int:
        return self._arena.compactions

    def pack(self, weights: LoRAWeights, pages: HostPages) -> PackedAdapter:
        """`weights` packed for this model's arena into host pages (any thread: touches no device)."""
        slices: dict[LoRALinear, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {m: {} for m in self._modules}
        scalings: dict[LoRALinear, dict[int, float]] = {m: {} for m in self._modules}  # each module's own
        for key, (a, b, scaling) in weights.modules.items():
            module, out_slice = self._layers[key]
            slices[module][out_slice] = (a, b)
            scalings[module][out_slice] = scaling
        sizes, ranks = [], []
        for module in self._modules:
            module_ranks = module.lora.ranks_of(slices[module])
            ranks.append(tuple(module_ranks))
            sizes.append(aligned(module.slot_elems(module_ranks)))
        extras_at = sum(sizes)
        extras, extra_tensors = _extras_layout(weights, extras_at)
        nbytes = (extras_at + aligned(sum(math.prod(shape) for _, _, shape in extras.tensors) if extras else 0)) \
            * self._itemsize
        taken = pages.take(nbytes)
        runs = list(pages.runs(taken, nbytes))
        # Pages in one run take the packing directly; scattered ones get it through one staging copy.
        staging = runs[0][1] if len(runs) == 1 else torch.empty(nbytes, dtype=torch.uint8)
        buffer = staging.view(self.dtype)
        parts, offset = [], 0
        for module, size, module_ranks in zip(self._modules, sizes, ranks):
            if size:
                module.lora.pack(slices[module], buffer[offset:offset + size])  # copy_ converts the dtype on the way
            parts.append((offset, module_ranks, tuple(scalings[module].get(s, 0.0) for s in range(len(module_ranks)))))
            offset += size
        if extras is not None:
            for name, at, shape in extras.tensors:
                buffer[at:at + math.prod(shape)].copy_(extra_tensors[name].reshape(-1))
        if len(runs) > 1:
            for start, view in runs:
                view.copy_(staging[start:start + view.numel()])
        return PackedAdapter(weights.name, weights.rank, self.dtype, nbytes, taken, tuple(parts), pages, extras)

    def install(self, slot: int, packed: PackedAdapter, stream: torch.cuda.Stream | None) -> AdapterCopy | None:
        """Point `slot` at `packed` and copy it into the arena; -> the copy's events on CUDA (`stream`
        given), None when the copy is done already. The caller's budget guarantees the bytes are free."""
        assert slot not in self._offsets, f"slot {slot} is taken"
        elems = packed.nbytes // self._itemsize
        offset = self._arena.alloc(elems)
        if offset is None:
            self._compact(stream)
            offset = self._arena.alloc(elems)
        assert offset is not None, f"{elems} elements do not fit an arena with {self._arena.free_elems} free"
        self._offsets[slot] = offset
        if packed.extras is not None:
            self._extras[slot] = packed.extras
        if stream is None:
            self._point(slot, offset, packed)
            self._copy(offset, packed, 0, packed.nbytes)
            return None
        with torch.cuda.stream(stream):
            self._point(slot, offset, packed)
            return self._copy_in_pieces(offset, packed)

    def free(self, slot: int) -> None:
        """`slot`'s adapter leaves the GPU. If it is folded into the base weights (merged mode), those are
        restored first: the slot's next adapter, perhaps another version of the same name, must not find
        itself merged already."""
        if self._merge_switch is not None:
            self._merge_switch.release_slot(slot)
        self._arena.free(self._offsets.pop(slot))
        self._extras.pop(slot, None)
        for module in self._modules:  # the device rows stay stale, unread, until the slot's next install
            module.lora.clear(slot, upload=False)

    def _point(self, slot: int, offset: int, packed: PackedAdapter) -> None:
        """Every projection's table rows for `slot` (on the current stream: before the copy, which the
        rows' readers wait for)."""
        for module, (part, ranks, scalings) in zip(self._modules, packed.parts):
            if any(ranks):
                module.lora.place(slot, offset + part, ranks, scalings, upload=False)
            else:
                module.lora.clear(slot, upload=False)
        upload_rows(self._stacks, slot)  # every row of the slot: a projection it skips may hold a stale one

    def _copy_in_pieces(self, offset: int, packed: PackedAdapter) -> AdapterCopy:
        """On the current stream: the copy in pieces of whole projections, in the packing's (layer) order,
        each followed by an event."""
        ends = [part * self._itemsize for part, _, _ in packed.parts[1:]] + [packed.nbytes]
        # A projection the adapter skips reads only the slot's table rows (written above, rank 0): it waits
        # for them, not for stale rows of the slot's last adapter.
        tables = torch.cuda.Event()
        tables.record()
        by_module = dict.fromkeys(self._modules, tables)
        piece_start, piece = 0, []
        for module, end in zip(self._modules, ends):
            piece.append(module)
            if end - piece_start >= COPY_PIECE_BYTES or (end == packed.nbytes and end > piece_start):
                self._copy(offset, packed, piece_start, end)
                event = torch.cuda.Event()
                event.record()
                by_module.update(dict.fromkeys(piece, event))
                piece_start, piece = end, []
        done = torch.cuda.Event()
        done.record()
        return AdapterCopy(done, by_module)

    def _copy(self, offset: int, packed: PackedAdapter, first: int, last: int) -> None:
        """Bytes [first, last) of `packed` to the arena at `offset` (elements), from its runs of pages."""
        arena_bytes = self._arena.data.view(torch.uint8)[offset * self._itemsize:]
        for start, view in packed.pool.runs(packed.pages, packed.nbytes):
            lo, hi = max(first, start), min(last, start + view.numel())
            if lo < hi:
                arena_bytes[lo:hi].copy_(view[lo - start:hi - start], non_blocking=True)

    def _compact(self, stream: torch.cuda.Stream | None) -> None:
        """Close the arena's holes on the compute stream, after the copies in flight on `stream` (they
        write ranges that may move), and make `stream` wait for it."""
        compute = torch.cuda.current_stream(self.device) if stream is not None else None
        if stream is not None:
            compute.wait_stream(stream)
        moves = self._arena.compact()
        for slot, offset in self._offsets.items():
            if offset in moves:
                for module in self._modules:
                    if any(module.lora.host_ranks[slot]):
                        module.lora.rebase(slot, moves[offset] - offset)
                self._offsets[slot] = moves[offset]
        if stream is not None:
            stream.wait_stream(compute)


def _extras_layout(weights: LoRAWeights, start: int) -> tuple[PackedExtras | None, dict[str, torch.Tensor]]:
    """Where the head's and the tower LoRA's tensors lie, one after another from element `start` (unaligned:
    bytes_of counts them as one aligned block); -> (that layout, the tensors by name), or None without either."""
    tensors = {**(weights.head.tensors if weights.head else {}), **(weights.tower.tensors if weights.tower else {})}
    if not tensors:
        return None, tensors
    layout, at = [], start
    for name, tensor in tensors.items():
        layout.append((name, at, tuple(tensor.shape)))
        at += tensor.numel()
    return PackedExtras(weights.head.head if weights.head else None, weights.tower.spec if weights.tower else None,
                        tuple(layout)), tensors


def _views(extras: PackedExtras, data: torch.Tensor, offset: int, names: list[str]) -> dict[str, torch.Tensor]:
    """`names` of `extras`, in that order, as views of `data` (an arena, or a host copy), the copy at `offset`."""
    where = {name: (at, shape) for name, at, shape in extras.tensors}
    return {name: data[offset + where[name][0]:offset + where[name][0] + math.prod(where[name][1])].view(where[name][1])
            for name in names}
