"""Per-pass LoRA on an image encoder's linears: one encoder pass over images of several adapters.

Lifecycle: `wrap` replaces each adaptable linear of a loaded encoder by a TowerLoRALinear (once, at load);
`adapted(...)` sets every wrapper's row segments for one pass and clears them after it. The images of a
pass lie in adapter order, those of one adapter contiguous, so each adapter is one row range per linear.
A linear's rows are its input's first dimension, in its own unit: LLaVA's CLIP and projector see
[images, tokens, hidden] (a row is an image); Qwen2-VL's ViT blocks see [patches, hidden] (a row is a
patch) and its merger [merged patches, hidden * merge^2]. Three images, adapters (a, a, none), Qwen2-VL
grids of 16, 16 and 4 patches, merge 2:

    unit "patch"   rows [0, 32) -> a's A and B      (image 2's rows [32, 36): the base linear alone)
    unit "merged"  rows [0, 8)  -> a's A and B
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from gpu_worker.lora.loader import LoRAModule, TowerWeights

Segment = tuple[int, int, LoRAModule]  # rows [start, end) add x @ A^T @ B^T * scaling


class TowerLoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, unit: str) -> None:
        super().__init__()
        self.base = base
        self.unit = unit  # which rows its input's first dimension counts ("image", "patch", "merged")
        self.segments: list[Segment] = []

    @property
    def weight(self) -> torch.Tensor:
        """The base weight: transformers reads some linears' weight for the dtype and device."""
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for start, end, (a, b, scaling) in self.segments:
            rows = x[start:end]
            out[start:end] += (rows @ a.T) @ b.T * scaling  # PEFT's lora_B(lora_A(x)) * scaling
        return out


def wrap(encoder: nn.Module, units: Mapping[str, str]) -> dict[str, TowerLoRALinear]:
    """Wrap `encoder`'s linears: PEFT module name ("model.visual.blocks.0.attn.qkv", which is "model." and
    the linear's path in the encoder) -> its unit. -> the wrappers by PEFT module name."""
    wrappers = {}
    for name, unit in units.items():
        parent, _, child = name.removeprefix("model.").rpartition(".")
        owner = encoder.get_submodule(parent)
        base = getattr(owner, child)  # nn.Sequential's children are attributes by their index too
        assert isinstance(base, nn.Linear), (name, base)
        wrappers[name] = TowerLoRALinear(base, unit)
        setattr(owner, child, wrappers[name])
    return wrappers


@contextmanager
def adapted(wrappers: Mapping[str, TowerLoRALinear], rows: Mapping[str, Sequence[int]],
            towers: Sequence[TowerWeights | None]) -> Iterator[None]:
    """For one pass over images whose towers are `towers` (one per image; same-adapter images adjacent,
    the same object): `rows[unit]` is each image's rows in that unit."""
    by_unit: dict[str, list[tuple[int, int, TowerWeights]]] = {}
    for unit, counts in rows.items():
        assert len(counts) == len(towers), (unit, counts, len(towers))
        segments, start = by_unit.setdefault(unit, []), 0
        for count, tower in zip(counts, towers):
            if tower is not None and segments and segments[-1][2] is tower and segments[-1][1] == start:
                segments[-1] = (segments[-1][0], start + count, tower)
            elif tower is not None:
                segments.append((start, start + count, tower))
            start += count
    modules = {id(tower): tower.modules() for tower in towers if tower is not None}
    try:
        for name, wrapper in wrappers.items():
            wrapper.segments = [(start, end, modules[id(tower)][name]) for start, end, tower in by_unit[wrapper.unit]
                                if name in modules[id(tower)]]
        yield
    finally:
        for wrapper in wrappers.values():
            wrapper.segments = []


def adapter_order(towers: Sequence[TowerWeights | None]) -> list[int]:
    """Image indices with each adapter's images adjacent (adapters, and the base tower, in order of first appearance)."""
    first: dict[int, int] = {}
    for i, tower in enumerate(towers):
        first.setdefault(id(tower) if tower is not None else 0, i)
    return sorted(range(len(towers)), key=lambda i: (first[id(towers[i]) if towers[i] is not None else 0], i))
