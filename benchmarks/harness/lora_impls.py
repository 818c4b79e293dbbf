"""The implementations kernel_bench runs of one LoRA op contract (`LoRAOp`): Tessera's Triton kernels
with the tuned table's or one static configuration (`Atmm`), and the two usual torch baselines
(`TorchLoop`, PEFT-like; `GatherBmm`, dLoRA-like). Each is bound to one (stack, batch) outside any
timing. The baselines read the same adapter weights as the kernels: PEFT-like, each adapter's own
tensors (views of the arena); dLoRA-like, stacked copies padded to the stack's max rank, as such
systems keep them."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Protocol

import torch

from kernels import tiling
from kernels.batch import NO_SLOT, LoRABatch
from kernels.lora_stack import LoRAStack
from kernels.triton import lora_expand as triton_expand
from kernels.triton import lora_shrink as triton_shrink

OPS = ("shrink", "expand")


class LoRAOp(Protocol):
    """One implementation bound to one (stack, batch); built outside any timing."""

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden] -> y in this implementation's own layout."""

    def expand(self, out: torch.Tensor, y: torch.Tensor) -> None:
        """out [tokens, hidden] += the LoRA delta from this implementation's y, in place."""

    def dense(self, y: torch.Tensor) -> torch.Tensor:
        """y as float32 [tokens, max_rank]; columns >= a token's rank are unspecified."""


Impl = Callable[[LoRAStack, LoRABatch], LoRAOp]


class Atmm:
    """The Triton kernels (kernels/triton/); static: the table's fixed config (tiling.static_config) for every case."""

    def __init__(self, stack: LoRAStack, batch: LoRABatch, static: bool) -> None:
        self.stack, self.batch = stack, batch
        self.configs = {op: tiling.static_config(op, stack.device) if static else None for op in OPS}

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        return triton_shrink.lora_shrink(x, self.stack, self.batch, self.configs["shrink"])

    def expand(self, out: torch.Tensor, y: torch.Tensor) -> None:
        triton_expand.lora_expand(out, y, self.stack, self.batch, self.configs["expand"])

    def dense(self, y: torch.Tensor) -> torch.Tensor:
        return y.float().sum(0)[:, 0]  # y: [K splits, tokens, 1 slice, max_rank] (triton_shrink.y_dtype)


def slot_rows(batch: LoRABatch) -> dict[int, list[int]]:
    """Tokens of each slot, slots in order of first appearance (read from the host tuples)."""
    rows: dict[int, list[int]] = {}
    for start, n, slot in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots):
        if slot != NO_SLOT and n > 0:
            rows.setdefault(slot, []).extend(range(start, start + n))
    return rows


def _index(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """A slice (view) when the tokens are contiguous, else an int64 device index (a gather)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.int64, device=device)


class TorchLoop:
    """PEFT-like: one matmul per adapter of the batch over its rows, into a dense y
    [tokens, max_rank] of the model dtype; expand adds each adapter's rows back."""

    def __init__(self, stack: LoRAStack, batch: LoRABatch) -> None:
        self.stack, self.num_tokens = stack, batch.num_tokens
        # (rows, A [rank, hidden], Bᵀ [rank, hidden], scaling as a host float, as PEFT keeps them)
        self.groups = [(_index(rows, stack.device), stack.a_weight(slot, 0), stack.b_weight(slot, 0),
                        stack.host_scalings[slot][0]) for slot, rows in slot_rows(batch).items()]

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        y = x.new_zeros(self.num_tokens, self.stack.max_rank)  # [tokens, max_rank]
        for rows, a, _, scaling in self.groups:
            y[rows, :a.shape[0]] = (x[rows] @ a.t()) * scaling
        return y

    def expand(self, out: torch.Tensor, y: torch.Tensor) -> None:
        for rows, _, b_t, _ in self.groups:
            rank = b_t.shape[0]
            if isinstance(rows, slice):
                out[rows].addmm_(y[rows, :rank], b_t)
            else:
                out.index_add_(0, rows, y[rows, :rank] @ b_t)

    def dense(self, y: torch.Tensor) -> torch.Tensor:
        return y.float()


class GatherBmm:
    """dLoRA-like: G groups (one per adapter) padded to the longest group's L rows and to the
    batch's largest rank R; weights gathered by slot inside the op, one bmm, valid rows scattered
    back. Example, slots (7, 3) with tokens [0, 2, 5] and [1]: idx_pad = [[0, 2, 5], [1, 0, 0]],
    valid = [0, 1, 2, 3] (flat padded positions), rows = [0, 2, 5, 1]."""

    def __init__(self, stack: LoRAStack, batch: LoRABatch) -> None:
        groups = slot_rows(batch)
        longest = max(map(len, groups.values()))
        device = stack.device
        self.stack, self.num_tokens = stack, batch.num_tokens
        self.a, self.b = padded_weights(stack)
        self.rank = max(stack.host_ranks[slot][0] for slot in groups)  # the batch's largest
        self.slots = torch.tensor(list(groups), dtype=torch.int64, device=device)  # [G]
        self.idx_pad = torch.tensor([rows + [0] * (longest - len(rows)) for rows in groups.values()],
                                    dtype=torch.int64, device=device)  # [G, L]; padding reads token 0
        self.valid = torch.tensor([g * longest + i for g, rows in enumerate(groups.values()) for i in range(len(rows))],
                                  dtype=torch.int64, device=device)  # [tokens in groups]
        self.rows = torch.tensor([t for rows in groups.values() for t in rows], dtype=torch.int64,
                                 device=device)  # [tokens in groups] token of each valid position

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        a_pad = self.a[self.slots, :self.rank]                             # [G, R, hidden]
        y_pad = torch.bmm(x[self.idx_pad], a_pad.transpose(1, 2))         # [G, L, R]
        y_pad.mul_(self.stack.scalings[self.slots, 0][:, None, None])
        y = x.new_zeros(self.num_tokens, self.stack.max_rank)              # [tokens, max_rank]
        y[self.rows, :self.rank] = y_pad.flatten(0, 1)[self.valid]
        return y

    def expand(self, out: torch.Tensor, y: torch.Tensor) -> None:
        b_pad = self.b[self.slots, :self.rank]                             # [G, R, hidden]
        delta = torch.bmm(y[self.idx_pad, :self.rank], b_pad)              # [G, L, hidden]
        out.index_add_(0, self.rows, delta.flatten(0, 1)[self.valid])

    def dense(self, y: torch.Tensor) -> torch.Tensor:
        return y.float()


# stack -> its padded copies, built once per stack (outside any timing) for all its GatherBmm ops
_PADDED: weakref.WeakKeyDictionary[LoRAStack, tuple[torch.Tensor, torch.Tensor]] = weakref.WeakKeyDictionary()


def padded_weights(stack: LoRAStack) -> tuple[torch.Tensor, torch.Tensor]:
    """The stack's one-slice adapters stacked by slot and zero-padded to its max rank, as vLLM-like and
    dLoRA-like systems keep them: (A [slots, max_rank, hidden], Bᵀ [slots, max_rank, hidden])."""
    if stack not in _PADDED:
        a = stack.arena.data.new_zeros(stack.num_slots, stack.max_rank, stack.in_features)
        b = stack.arena.data.new_zeros(stack.num_slots, stack.max_rank, stack.out_features)
        for slot, (rank,) in enumerate(stack.host_ranks):
            a[slot, :rank] = stack.a_weight(slot, 0)
            b[slot, :rank] = stack.b_weight(slot, 0)
        _PADDED[stack] = (a, b)
    return _PADDED[stack]


IMPLS: dict[str, Impl] = {
    "atmm_tuned": functools.partial(Atmm, static=False),
    "atmm_static": functools.partial(Atmm, static=True),
    "torch_loop": TorchLoop,
    "gather_bmm": GatherBmm,
}
