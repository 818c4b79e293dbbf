"""A bucket's inputs on the GPU, and the calls the search times and checks against the reference."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from kernels import reference, tiling
from kernels.adapter_arena import AdapterArena
from kernels.batch import NO_SLOT, LoRABatch
from kernels.lora_stack import LoRAStack, packed_elems
from kernels.tiling import Bucket, Config
from kernels.triton import lora_expand as triton_expand
from kernels.triton import lora_shrink as triton_shrink
from kernels.tuner import timing
from kernels.tuner.batches import batch_shapes, segments
from kernels.tuner.candidates import tile_shapes
from kernels.tuner.search import CheckFailed, first_line

MEMORY_CAP = 20 * 10**9  # bytes of rotating inputs (stack slots included) one bucket may allocate
MAX_COPIES = 1024  # rotating copies at most (a graph of as many calls). With 32, tiny ops ran with
# their weights in L2 and the tuner ranked their configurations unlike the kernel benchmark
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}  # vs the float32 reference


def copy_bytes(bucket: Bucket, elem_size: int, splits: int = 1) -> tuple[int, int]:
    """(bytes one call moves, bytes one input copy allocates: its activations and its stack slots)."""
    t, k, r, n = bucket.tokens, bucket.in_features, bucket.block_r, sum(bucket.out_sizes)
    slices, groups = len(bucket.out_sizes), max(len(shape.lens) for shape in batch_shapes(bucket))
    y = splits * t * slices * r * (4 if splits > 1 else elem_size)  # float32 planes, or one (triton_shrink.y_dtype)
    a, b = groups * slices * r * k * elem_size, groups * n * r * elem_size
    if bucket.op == "shrink":  # reads x and A, writes y
        return t * k * elem_size + a + y, t * k * elem_size + a + b
    return y + b + 2 * t * n * elem_size, y + t * n * elem_size + a + b  # reads y, B, out; writes out


def rotation_copies(bucket: Bucket, elem_size: int, splits: int = 1,
                    needed: Callable[[int], int] = timing.copies_needed) -> int:
    """Input copies to cycle through: for each batch shape, enough to span 3x L2 on their own (each
    shape is timed apart), few enough to stay under MEMORY_CAP."""
    moved, allocated = copy_bytes(bucket, elem_size, splits)
    wanted = needed(moved) * len(batch_shapes(bucket))
    return max(1, min(wanted, MEMORY_CAP // allocated, MAX_COPIES))


def random_stack(bucket: Bucket, ranks: Sequence[int], dtype: torch.dtype, device: torch.device | str,
                 generator: torch.Generator) -> LoRAStack:
    """A slot for each of `ranks` (0: empty), that rank on every slice, packed in slot order into an
    arena of just their size, served up to block_r. A and B entries have standard deviation
    (k block_r)^-1/4, so the LoRA delta of unit x has unit variance. Filled in one op and placed in one
    table update (thousands of slots)."""
    slices, k = len(bucket.out_sizes), bucket.in_features
    sizes = [packed_elems(k, bucket.out_sizes, [rank] * slices) for rank in ranks]
    arena = AdapterArena(sum(sizes), dtype, device)
    stack = LoRAStack.empty(len(ranks), k, bucket.out_sizes, bucket.block_r, arena)
    offsets = [arena.alloc(size) if size else 0 for size in sizes]
    arena.data.normal_(0.0, (k * bucket.block_r) ** -0.25, generator=generator)
    used = [slot for slot, rank in enumerate(ranks) if rank]
    stack.place_many(used, [offsets[slot] for slot in used], [[ranks[slot]] * slices for slot in used],
                     [[1.0] * slices for _ in used])
    return stack


@dataclass(eq=False)  # holds tensors
class Workload:
    """A bucket's representative batches (`batch_shapes`), taken in turn by `copies` copies. Copy c
    has its own activations and its own slot range of one shared stack, so cycling the copies
    moves weights (most of a decode op's bytes) and activations alike through more than the L2."""
    bucket: Bucket
    stack: LoRAStack             # [copies * groups] slots, groups: the most of any shape
    batches: list[LoRABatch]     # copy c: shape c % shapes' segments, group i on slot c * groups + i
    inputs: list[torch.Tensor]   # shrink: x [T, in_features]; expand: y [splits, T, slices, block_r] (y_dtype)
    outs: list[torch.Tensor]     # expand: out [T, out_features]; shrink: none

    @staticmethod
    def build(bucket: Bucket, copies: int, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
              splits: int = 1) -> Workload:
        """`splits`: expand's y planes, as the shrink configuration of the same shape writes them."""
        generator = torch.Generator(device=device).manual_seed(seed)
        kinds = batch_shapes(bucket)
        shapes = [kinds[c % len(kinds)] for c in range(copies)]
        groups = max(len(shape.lens) for shape in shapes)
        # Copy c's slots: its shape's ranks, then rank-0 slots no group uses (padding to `groups`).
        ranks = [rank for shape in shapes for rank in [*shape.ranks, *[0] * (groups - len(shape.ranks))]]
        stack = random_stack(bucket, ranks, dtype, device, generator)
        batches = []
        for c, shape in enumerate(shapes):
            seg_lens, seg_groups = segments(shape.lens)
            # One capacity for all: every copy runs the same compiled kernel over the same grid.
            batches.append(LoRABatch.build(seg_lens, [c * groups + g for g in seg_groups], device, capacity=groups,
                                           mean_rank=shape.mean_rank if bucket.mixed else None))
        t, slices, out_features = bucket.tokens, len(bucket.out_sizes), sum(bucket.out_sizes)
        new = partial(torch.randn, device=device, generator=generator)
        if bucket.op == "shrink":
            inputs, outs = [new(t, bucket.in_features, dtype=dtype) for _ in batches], []
        else:
            inputs = [new(splits, t, slices, bucket.block_r, dtype=triton_shrink.y_dtype(splits, dtype)) for _ in batches]
            outs = [new(t, out_features, dtype=dtype) for _ in batches]
        work = Workload(bucket, stack, batches, inputs, outs)
        assert all(tiling.bucket_of(bucket.op, stack, b) == bucket for b in batches), bucket  # lookup finds it
        return work

    def call(self, config: Config, copy: int, compile_only: bool = False) -> Callable[[], object]:
        if self.bucket.op == "shrink":
            return partial(triton_shrink.lora_shrink, self.inputs[copy], self.stack, self.batches[copy], config,
                           compile_only)
        return partial(triton_expand.lora_expand, self.outs[copy], self.inputs[copy], self.stack, self.batches[copy],
                       config, compile_only)

    def seconds(self, config: Config) -> tuple[float, ...]:
        """Seconds per call on each batch shape: one graph over the copies of each."""
        shapes = min(len(self.batches), len(batch_shapes(self.bucket)))
        return tuple(timing.graph_time_s([self.call(config, c) for c in range(shape, len(self.batches), shapes)])
                     for shape in range(shapes))

    def check(self, config: Config) -> None:
        """`config` on the first copy of each shape against the float32 reference on float32 copies
        of its inputs."""
        checked = min(len(self.batches), len(batch_shapes(self.bucket)))
        slots = checked * self.stack.num_slots // len(self.batches)  # those copies' slots
        s = self.stack
        exact = s.copy(torch.float32, s.device, slots)
        for copy in range(checked):
            batch, x = self.batches[copy], self.inputs[copy]
            try:
                if self.bucket.op == "shrink":
                    got = triton_shrink.lora_shrink(x, s, batch, config).sum(0, keepdim=True)
                    want = reference.lora_shrink(x.float(), exact, batch)
                    got = torch.where(_specified(s, batch), got, 0.0)  # the reference's zeros
                else:
                    got, want = self.outs[copy].clone(), self.outs[copy].float()
                    triton_expand.lora_expand(got, x, s, batch, config)
                    reference.lora_expand(want, x, exact, batch)
            except Exception as exc:
                raise CheckFailed(f"{self.bucket.key}: {config} failed to run: {first_line(exc)}") from exc
            tol, scale = TOLERANCE[s.dtype], want.abs().max().item()
            if not torch.allclose(got.float(), want, rtol=tol, atol=tol * scale):
                error = (got.float() - want).abs().nan_to_num(math.inf).max().item()
                raise CheckFailed(f"{self.bucket.key}: {config} is off the reference by {error:.3g} "
                                  f"(scale {scale:.3g}, batch shape {copy})")


def _specified(stack: LoRAStack, batch: LoRABatch) -> torch.Tensor:
    """[1, tokens, slices, max_rank] bool: the entries of y that lora_shrink defines (columns under
    the rank of the token's adapter on that slice)."""
    ranks = torch.zeros(batch.num_tokens, stack.num_slices, dtype=torch.int64)
    for start, n, slot in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots):
        if slot != NO_SLOT:
            ranks[start:start + n] = torch.tensor(stack.host_ranks[slot])
    return (torch.arange(stack.max_rank) < ranks[..., None])[None].to(stack.device)


def compile_candidates(bucket: Bucket, dtype: str, splits: int) -> None:
    """Worker: compile the bucket's heuristic and stage-1 candidates for its one-copy workload
    without launching them (the GPU stays the timing's alone), which leaves them in Triton's
    on-disk cache. One that fails to compile is skipped here; the timing reports it."""
    work = Workload.build(bucket, 1, getattr(torch, dtype), "cuda", splits=splits)
    for config in dict.fromkeys([tiling.heuristic_config(bucket), *tile_shapes(bucket)]):
        try:
            work.call(config, 0, compile_only=True)()
        except Exception:  # noqa: BLE001 - e.g. out of shared memory; timing it will say so
            pass
