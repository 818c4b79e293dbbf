"""VaLoRA's merged inference for steps whose every token uses one adapter.

While a run of steps all use the same adapter, its B·A (times its scaling) is folded into the base
weights of the projections it targets, and those steps run as base-only steps: no LoRA kernels
at all, so a batch on one adapter costs what a base batch costs. A step that needs anything else
(another adapter, the base model, a mix) first restores the base weights. Restoring copies back
the weights saved before the merge, so the base weights never drift, however often the mode
switches. Merging waits until the same adapter has filled `after_steps` steps in a row, so that
a mix that only briefly looks uniform does not pay for a merge and an unmerge.

If the GPU has no room for the saved copy, merged mode turns itself off (logged) and steps run
unmerged.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from gpu_worker.lora.layer import LoRALinear
from gpu_worker.step_inputs import StepInputs
from kernels import NO_SLOT
from kernels.merge import MergeTarget, merge_weights, restore_weights, warm_up_merge

log = logging.getLogger(__name__)


class MergedMode:
    def __init__(self, modules: list[LoRALinear], after_steps: int) -> None:
        assert after_steps >= 1, after_steps
        self._modules = [m for m in modules if m.lora is not None]
        self._after_steps = after_steps
        self._targets: dict[int, MergeTarget] = {}  # id(module) -> its weight and the backup saved at merge
        self._merged: tuple[int, str] | None = None  # (slot, adapter name) folded into the weights
        self._merged_targets: list[MergeTarget] = []  # weights that hold it (the slot may be reused later)
        self._candidate: tuple[int, str] | None = None
        self._streak = 0
        self._enabled = True

    @property
    def merged_adapter(self) -> str | None:
        return self._merged[1] if self._merged else None

    def prepare(self, inputs: StepInputs) -> StepInputs:
        """Merge or unmerge as this step needs; -> the inputs to run (base-only when merged)."""
        uniform = self._uniform_adapter(inputs)
        if uniform is not None and uniform == self._merged:
            return _as_base_only(inputs)
        self._streak = self._streak + 1 if uniform is not None and uniform == self._candidate else 1
        self._candidate = uniform
        if self._merged is not None:
            self._unmerge()
        if uniform is None or self._streak <= self._after_steps or not self._enabled:
            return inputs
        return _as_base_only(inputs) if self._merge(*uniform) else inputs

    def warm_up(self) -> None:
        """Compile the merge and restore kernels for all these projections before serving. A merge
        targets those its adapter does; the kernels differ only by the weights' dtype, alignment and
        padded rank, which every projection here shares in the models served."""
        warm_up_merge([MergeTarget(m.weight.data, m.weight.data, m.lora) for m in self._modules])

    def _uniform_adapter(self, inputs: StepInputs) -> tuple[int, str] | None:
        names = {item.seq.adapter.name if item.seq.adapter else None for item in inputs.items}
        if len(names) != 1 or None in names or len(set(inputs.seg_slots)) != 1:
            return None
        return inputs.seg_slots[0], names.pop()

    def _merge(self, slot: int, name: str) -> bool:
        targeted = [m for m in self._modules if any(m.lora.host_ranks[slot])]
        try:
            for module in targeted:
                if id(module) not in self._targets:
                    self._targets[id(module)] = MergeTarget(module.weight.data, torch.empty_like(module.weight),
                                                            module.lora)
        except torch.OutOfMemoryError:
            self._targets.clear()
            self._enabled = False
            log.warning("no memory to save base weights for merged mode; steps on one adapter run unmerged")
            return False
        targets = [self._targets[id(m)] for m in targeted]  # the same objects every time: see MergeTarget
        with torch.inference_mode():
            merge_weights(targets, slot)  # one launch on CUDA for every projection of every layer
        self._merged, self._merged_targets = (slot, name), targets
        return True

    def _unmerge(self) -> None:
        with torch.inference_mode():
            restore_weights(self._merged_targets)
        self._merged, self._merged_targets = None, []


def _as_base_only(inputs: StepInputs) -> StepInputs:
    return dataclasses.replace(inputs, seg_slots=[NO_SLOT] * len(inputs.seg_slots))
