"""VaLoRA's merged inference, the mechanism: fold one adapter slot into the base weights, and restore them.

While an adapter is merged, its B·A (times its scaling) is added to the base weights of the
projections it targets, and steps run as base-only steps: no LoRA kernels at all, so a batch on one
adapter costs what a base batch costs. In mixture mode (deLoRA) the other tokens of a step run on
those weights too, each adding its own adapter's delta and the merged adapter's negated: the stacks'
last slot (`mixture_slot`) points at the merged adapter's weights with its scalings negated. Restoring copies back the weights saved before the merge, so
the base weights never drift, however often the mode switches. When to merge and unmerge is the
orchestrator's decision (gpu_worker/orchestrator.py); the model runner brings the weights to what
it planned through `hold`.

The saved copy (of every adapted projection's weight: a restore must be exact) is allocated when the
switch is made, before the worker sizes its KV cache on the memory left, so that merged mode has it
whatever the cache takes. If the device has no room for it, the switch is off (logged): `available`
is False, and every step runs unmerged.
"""

from __future__ import annotations

import logging
import time

import torch

from gpu_worker.lora.layer import LoRALinear
from kernels import merge_weights, restore_weights, upload_rows, warm_up_merge
from kernels.merge import MergeTarget

log = logging.getLogger(__name__)

# A merge reads the weights and writes them and their backup, a restore reads the backup and writes the
# weights: 3 and 2 weight-sized transfers, against the 2 of the copy timed at start (the first estimate).
OVER_COPY = {"merge": 3 / 2, "restore": 1.0}
SWITCH_TIME_WEIGHT = 0.25  # of the newest measured merge (restore) in the running estimate


class MergeSwitch:
    def __init__(self, modules: list[LoRALinear]) -> None:
        """`modules`' stacks keep their last slot for mixture mode (`mixture_slot`)."""
        self._modules = [m for m in modules if m.lora is not None]
        self.mixture_slot = self._modules[0].lora.num_slots - 1 if self._modules else -1
        self._merged: tuple[int, str] | None = None  # (slot, adapter name) folded into the weights
        self._merged_targets: list[MergeTarget] = []  # weights that hold it (the slot may be reused later)
        # id(module) -> its weight and the buffer its backup is saved in at each merge
        self._targets: dict[int, MergeTarget] = {}
        try:
            for module in self._modules:
                self._targets[id(module)] = MergeTarget(module.weight.data, torch.empty_like(module.weight),
                                                        module.lora)
        except torch.OutOfMemoryError:
            self._targets.clear()
            log.warning("no memory to save base weights for merged mode; steps on one adapter run unmerged")
        self.available = bool(self._targets) or not self._modules
        copy_s = self._time_backup_copy()
        self._seconds = {kind: copy_s * factor for kind, factor in OVER_COPY.items()}
        self._timings: list[tuple[str, _Mark, _Mark]] = []  # (kind, start, end) of switches not read yet

    @property
    def switch_s(self) -> float:
        """About how long a merge and its restore take together, measured."""
        while self._timings and _done(self._timings[0][2]):
            kind, start, end = self._timings.pop(0)
            self._seconds[kind] += SWITCH_TIME_WEIGHT * (_elapsed_s(start, end) - self._seconds[kind])
        return sum(self._seconds.values())

    def _time_backup_copy(self) -> float:
        """Seconds to copy every adapted projection's weight into its backup (what the merge copies)."""
        targets = list(self._targets.values())
        if not targets:
            return 0.0
        device = targets[0].weight.device
        _sync(device)
        started = time.perf_counter()
        for target in targets:
            target.backup.copy_(target.weight)
        _sync(device)
        return time.perf_counter() - started

    @property
    def reserved_bytes(self) -> int:
        """Device memory held for the base weights' backups."""
        return sum(t.backup.numel() * t.backup.element_size() for t in self._targets.values())

    @property
    def merged(self) -> tuple[int, str] | None:
        """(slot, adapter name) folded into the base weights now, if any."""
        return self._merged

    @property
    def merged_adapter(self) -> str | None:
        return self._merged[1] if self._merged else None

    def hold(self, adapter: tuple[int, str] | None) -> bool:
        """Bring the weights to hold `adapter` (slot, name) merged, or none: restore whatever else is
        merged first. -> whether an adapter is merged now."""
        if adapter == self._merged:
            return adapter is not None
        if self._merged is not None:
            self._unmerge()
        if adapter is not None:
            self._merge(*adapter)
        return adapter is not None

    def release_slot(self, slot: int) -> None:
        """`slot`'s adapter leaves GPU memory: restore the base weights if it is the one merged."""
        if self._merged is not None and self._merged[0] == slot:
            self._unmerge()

    def warm_up(self) -> None:
        """Compile the merge and restore kernels for all these projections before serving. A merge
        targets those its adapter does; the kernels differ only by the weights' dtype, alignment and
        padded rank, which every projection here shares in the models served."""
        warm_up_merge([MergeTarget(m.weight.data, m.weight.data, m.lora) for m in self._modules])

    def _merge(self, slot: int, name: str) -> None:
        assert self._merged is None and self.available, (self._merged, name)
        targeted = [m for m in self._modules if any(m.lora.host_ranks[slot])]
        targets = [self._targets[id(m)] for m in targeted]  # the same objects every time: see MergeTarget
        for module in self._modules:  # mixture mode's slot: the merged adapter, negated
            module.lora.mirror(slot, self.mixture_slot, -1.0, upload=False)
        upload_rows([m.lora for m in self._modules], self.mixture_slot)
        started = self._mark()
        with torch.inference_mode():
            merge_weights(targets, slot)  # one launch on CUDA for every projection of every layer
        self._timings.append(("merge", started, self._mark()))
        self._merged, self._merged_targets = (slot, name), targets

    def _unmerge(self) -> None:
        started = self._mark()
        with torch.inference_mode():
            restore_weights(self._merged_targets)
        self._timings.append(("restore", started, self._mark()))
        self._merged, self._merged_targets = None, []

    def _mark(self) -> _Mark:
        """A point in the device's stream to time from (an event on CUDA: no sync)."""
        if self._modules[0].weight.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


_Mark = float | torch.cuda.Event


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _done(mark: _Mark) -> bool:
    return isinstance(mark, float) or mark.query()


def _elapsed_s(start: _Mark, end: _Mark) -> float:
    return end - start if isinstance(end, float) else start.elapsed_time(end) / 1e3

