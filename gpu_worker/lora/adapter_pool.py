"""A fixed number of adapter slots inside the model's LoRALinear layers, with an eviction policy.

A slot is pinned while running sequences use it (one pin per sequence); only unpinned slots are
evicted, the one the policy keeps least first (services/common/scheduling/eviction.py, shared with
the gateway's cluster model). An adapter is touched each time a sequence releases it, on a clock
that counts releases: with LRU, the default, the adapter whose last pin was released longest ago
goes first. When every slot is pinned by other adapters, `acquire` returns None and the request waits.

Loading runs in the engine thread between steps. Whatever goes wrong there (checksum mismatch, a
truncated config, an OSError, a torch error) leaves the pool as it was and raises AdapterLoadFailed,
which fails only the requests for that adapter; the traceback goes to the log, not to the client.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from gpu_worker.lora.layer import LoRALinear
from gpu_worker.lora.loader import AdapterRef, LoRAWeights
from services.common.errors import AdapterLoadFailed, TesseraError
from services.common.scheduling.eviction import LRU, Eviction, Record

log = logging.getLogger(__name__)


def _cause(exc: Exception) -> str:
    """What went wrong, for the client: a domain error's message, else the exception's type and text
    (an OSError names its file, not the path: the store's layout is no client's business)."""
    if isinstance(exc, TesseraError):
        return exc.message
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}" + (f" ({Path(exc.filename).name})" if exc.filename else "")
    return f"{type(exc).__name__}: {exc}"


class AdapterPool:
    def __init__(self, layers: dict[tuple[int, str], tuple[LoRALinear, int]], num_slots: int,
                 load: Callable[[AdapterRef], LoRAWeights], eviction: Eviction = LRU()) -> None:
        self._layers = layers  # (layer, PEFT target) -> (module, output slice)
        self._modules = list({id(module): module for module, _ in layers.values()}.values())
        self._load = load
        self.num_slots = num_slots
        self._slot_of: dict[str, int] = {}
        self._rank_of_slot: dict[int, int] = {}
        self._pins = [0] * num_slots
        self._free = list(range(num_slots))
        self._eviction = eviction  # holds no state: the records are here
        self._records: dict[str, Record] = {}  # adapter -> its eviction record (kept across evictions)
        self._releases = itertools.count()      # the policy's clock

    def acquire(self, ref: AdapterRef) -> int | None:
        """Pin `ref`'s slot, loading it first if needed; None if no slot can be freed now.
        Raises AdapterLoadFailed, and nothing else, if the adapter cannot be loaded."""
        slot = self._slot_of.get(ref.name)
        if slot is None:
            slot = self._take_slot()
            if slot is None:
                return None
            try:
                self._install(slot, self._load(ref))
            except Exception as exc:
                self._reset(slot)  # an install that failed half way leaves nothing behind
                self._free.append(slot)
                log.exception("adapter %s (%s) could not be loaded; failing its requests", ref.name, ref.storage_path)
                raise AdapterLoadFailed(f"adapter {ref.name} could not be loaded: {_cause(exc)}") from exc
            self._slot_of[ref.name] = slot
        self._pins[slot] += 1
        return slot

    def release(self, name: str) -> None:
        slot = self._slot_of[name]
        assert self._pins[slot] > 0, name
        self._pins[slot] -= 1
        self._records[name] = self._eviction.touched(self._records.get(name), float(next(self._releases)))

    def num_pinned(self) -> int:
        """Pins held by running sequences (0 when the engine is idle)."""
        return sum(self._pins)

    def rank(self, slot: int) -> int:
        return self._rank_of_slot[slot]

    def resident(self) -> list[str]:
        return sorted(self._slot_of)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        unpinned = [name for name, slot in self._slot_of.items() if self._pins[slot] == 0]
        if not unpinned:
            return None
        victim = min(unpinned, key=lambda name: self._eviction.keep(self._records[name]))
        slot = self._slot_of.pop(victim)
        self._reset(slot)
        return slot

    def _reset(self, slot: int) -> None:
        for module in self._modules:
            module.reset_slot(slot)
        self._rank_of_slot.pop(slot, None)

    def _install(self, slot: int, weights: LoRAWeights) -> None:
        """Write every targeted slice; modules the adapter does not target get an empty slot."""
        slices: dict[LoRALinear, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {m: {} for m in self._modules}
        for key, (a, b) in weights.modules.items():
            module, out_slice = self._layers[key]
            slices[module][out_slice] = (a, b)
        for module, module_slices in slices.items():
            if module_slices:
                module.set_slot(slot, module_slices, weights.scaling)
            else:
                module.reset_slot(slot)
        self._rank_of_slot[slot] = weights.rank
