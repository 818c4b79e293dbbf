"""The kernel benchmark's cases: one square projection serving a batch of requests on n adapters (a hidden
size, a rank set, n, a token count, a decode or prefill layout), the bytes each op must move at least
once (its roofline), and fresh random inputs for it: a stack of the used adapters at their true ranks,
one copy a slot range, and the batches and rows that use them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product

import numpy as np
import torch

from benchmarks.harness.lora_impls import OPS
from kernels.adapter_arena import AdapterArena
from kernels.batch import LoRABatch
from kernels.lora_stack import LoRAStack, packed_elems, packed_layout

RANK_SETS = {"u16": (16,), "u64": (64,), "mixed": (8, 16, 32, 64, 128)}  # adapter j: set[j % len]
LAYOUTS = ("decode", "prefill")
SEED = 0


# ---- cases ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    hidden: int
    ranks: str                     # key of RANK_SETS
    adapters: int                  # n distinct adapters; adapter j has rank RANK_SETS[ranks][j % len]
    layout: str                    # "decode" | "prefill"
    seg_lens: tuple[int, ...]      # [requests] tokens of each request, laid end to end
    seg_adapters: tuple[int, ...]  # [requests] adapter (0..n-1) of each request

    @property
    def tokens(self) -> int:
        return sum(self.seg_lens)

    @property
    def name(self) -> str:
        return f"h{self.hidden} {self.ranks} n{self.adapters} t{self.tokens} {self.layout}"

    @property
    def max_rank(self) -> int:  # the stack's rank padding
        return max(RANK_SETS[self.ranks])

    @property
    def adapter_ranks(self) -> tuple[int, ...]:  # [n]
        ranks = RANK_SETS[self.ranks]
        return tuple(ranks[j % len(ranks)] for j in range(self.adapters))

    @property
    def adapter_scalings(self) -> tuple[float, ...]:  # [n] unequal: reading a wrong slot's shows
        return tuple(0.5 + 0.25 * (j % 4) for j in range(self.adapters))

    def token_ranks(self) -> list[int]:
        """[tokens] rank of each token's adapter."""
        return [self.adapter_ranks[j] for n, j in zip(self.seg_lens, self.seg_adapters) for _ in range(n)]

    def used_adapters(self) -> list[int]:
        """The adapters some token uses (with fewer requests than adapters, not all)."""
        return sorted(set(self.seg_adapters))

    def used_ranks(self) -> list[int]:
        return [self.adapter_ranks[j] for j in self.used_adapters()]


def make_case(hidden: int, ranks: str, adapters: int, tokens: int, layout: str) -> Case:
    """Request i uses adapter i % n; decode: `tokens` one-token requests; prefill: min(tokens, 2n)
    requests of random positive lengths. Requests are shuffled; a prefill's order keeps one
    adapter's requests apart, so the kernels gather its rows. The same (n, tokens, layout) gives
    the same requests at every hidden size and rank set."""
    assert layout in LAYOUTS and ranks in RANK_SETS and adapters >= 1 and tokens >= 1
    rng = np.random.default_rng([SEED, adapters, tokens, LAYOUTS.index(layout)])
    if layout == "decode":
        lens = [1] * tokens
    else:
        lens = _random_split(tokens, min(tokens, 2 * adapters), rng)
    order = _shuffle(len(lens), adapters, rng, apart=layout == "prefill")
    return Case(hidden, ranks, adapters, layout, tuple(lens[i] for i in order), tuple(i % adapters for i in order))


def make_cases(hidden: Sequence[int], ranks: Sequence[str], adapters: Sequence[int], tokens: Sequence[int],
               layouts: Sequence[str]) -> list[Case]:
    """The grid; a one-token prefill would repeat decode and is left out."""
    return [make_case(h, r, n, t, layout) for h, r, n, layout, t in product(hidden, ranks, adapters, layouts, tokens)
            if not (layout == "prefill" and t == 1)]


def _random_split(total: int, parts: int, rng: np.random.Generator) -> list[int]:
    """`parts` positive ints summing to `total`: distinct random cut points."""
    cuts = np.sort(rng.choice(np.arange(1, total), parts - 1, replace=False))
    return np.diff([0, *cuts, total]).tolist()


def _shuffle(requests: int, adapters: int, rng: np.random.Generator, apart: bool) -> list[int]:
    """A random order of requests 0..requests-1 (request i uses adapter i % adapters); with
    `apart`, no two neighbours share an adapter. Each adapter has at most 2 requests here, so
    with n >= 2 about one shuffle in three qualifies."""
    for _ in range(1000):
        order = rng.permutation(requests).tolist()
        if not apart or adapters == 1 or all(a % adapters != b % adapters for a, b in zip(order, order[1:])):
            return order
    raise AssertionError(f"no order keeps the requests of {adapters} adapters apart")


# ---- roofline ------------------------------------------------------------------------------

def min_bytes(op: str, case: Case, elem_bytes: int = 2) -> int:
    """Bytes the op must move at least once: the used adapters' A (shrink) or B (expand) at their
    true ranks, y at each token's own rank, and x read (shrink) or out read and written (expand)."""
    assert op in OPS, op
    weights = sum(case.used_ranks()) * case.hidden * elem_bytes
    y = sum(case.token_ranks()) * elem_bytes
    rows = case.tokens * case.hidden * elem_bytes * (1 if op == "shrink" else 2)
    return weights + y + rows


# ---- inputs --------------------------------------------------------------------------------

def random_stack(case: Case, copies: int, dtype: torch.dtype, device: torch.device | str,
                 generator: torch.Generator) -> LoRAStack:
    """Each copy's used adapters in slots of their own (`copy_batch`), with their ranks and
    scalings and fresh weights (A ~ N(0, 1/hidden), B ~ N(0, 1/r): y and expand's delta are
    O(scaling) for x ~ N(0, 1)), packed at their true ranks into an arena of just their size.
    Unused adapters get no slot: a one-token batch of 64 adapters rotates thousands of copies of
    the one it uses.

    Filled a rank at a time (that rank's slots side by side in the arena: their A blocks are one
    strided view, their B blocks another) and placed in one table update, rather than slot by slot
    with set_slot (thousands of slots for small cases).
    """
    used = case.used_adapters()
    adapters = [used[s % len(used)] for s in range(copies * len(used))]  # [slots] adapter in each
    ranks = [case.adapter_ranks[j] for j in adapters]
    hidden = case.hidden
    arena = AdapterArena(sum(packed_elems(hidden, (hidden,), [r]) for r in ranks), dtype, device)
    stack = LoRAStack.empty(len(adapters), hidden, (hidden,), case.max_rank, arena)
    offsets = [0] * len(ranks)
    for rank in sorted(set(ranks)):
        slots = [slot for slot, r in enumerate(ranks) if r == rank]
        (a_rel,), (b_rel,), size = packed_layout(hidden, (hidden,), [rank])
        for slot in slots:
            offsets[slot] = arena.alloc(size)
        first = offsets[slots[0]]
        assert offsets[slots[-1]] == first + (len(slots) - 1) * size  # a fresh arena fills in order
        block = arena.data[first:first + len(slots) * size].view(len(slots), size)  # [slots, size]
        block[:, a_rel:a_rel + rank * hidden].normal_(generator=generator).mul_(hidden ** -0.5)
        block[:, b_rel:b_rel + rank * hidden].normal_(generator=generator).mul_(rank ** -0.5)
    stack.place_many(range(len(ranks)), offsets, [[r] for r in ranks], [[case.adapter_scalings[j]] for j in adapters])
    return stack


def copy_batch(case: Case, copy: int, device: torch.device | str) -> LoRABatch:
    """The case's requests on copy `copy`'s slots: the k-th used adapter in slot copy * used + k.
    The batch knows its largest rank and its token-weighted mean rank, as the engine's batches do."""
    used = case.used_adapters()
    slot = {j: copy * len(used) + k for k, j in enumerate(used)}
    return LoRABatch.build(case.seg_lens, [slot[j] for j in case.seg_adapters], device, max_rank=max(case.used_ranks()),
                           mean_rank=sum(case.token_ranks()) / case.tokens)


def random_rows(copies: int, case: Case, dtype: torch.dtype, device: torch.device | str,
                generator: torch.Generator) -> torch.Tensor:
    """[copies, tokens, hidden] N(0, 1): inputs x, or base outputs."""
    return torch.randn(copies, case.tokens, case.hidden, generator=generator, device=device).to(dtype)


def case_inputs(case: Case, copies: int, device: torch.device | str, dtype: torch.dtype
                ) -> tuple[LoRAStack, list[LoRABatch], torch.Tensor, torch.Tensor]:
    """(stack, each copy's batch, x [copies, tokens, hidden], base outputs [copies, tokens, hidden])."""
    generator = torch.Generator(device).manual_seed(SEED + 1)
    stack = random_stack(case, copies, dtype, device, generator)
    batches = [copy_batch(case, c, device) for c in range(copies)]
    xs = random_rows(copies, case, dtype, device, generator)
    return stack, batches, xs, random_rows(copies, case, dtype, device, generator)
