"""Per-step metadata that attention and LoRA layers read, instead of threading it through forward().

The model runner sets it around one forward pass; layers call `get_forward_context()`. A
ContextVar keeps it private to the thread running the engine (tests may run models elsewhere).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kernels import LoRABatch
from kernels.attention import AttentionMetadata

if TYPE_CHECKING:
    import torch

    from gpu_worker.kv_cache import PagedKVCache


class CpuLoraRows(Protocol):
    """A step's rows whose LoRA deltas are computed off the GPU (lora/cpu_assist.py's CpuLoraStep)."""

    def start(self, module: torch.nn.Module, x: torch.Tensor) -> Callable[[torch.Tensor], None] | None: ...


# Per projection, the device events its LoRA kernels wait for: adapters' copies onto the GPU still in
# flight (layer-pipelined loading, lora/gpu_memory.py).
LoraWaits = Mapping["torch.nn.Module", Sequence["torch.cuda.Event"]]


@dataclass(frozen=True)
class ForwardContext:
    attention: AttentionMetadata
    kv_cache: PagedKVCache
    lora: LoRABatch
    cpu_lora: CpuLoraRows | None = None  # rows whose LoRA deltas the CPU LoRA workers compute
    lora_waits: LoraWaits | None = None


_CONTEXT: ContextVar[ForwardContext | None] = ContextVar("tessera_forward_context", default=None)


def get_forward_context() -> ForwardContext:
    context = _CONTEXT.get()
    assert context is not None, "layers run only inside forward_context(...)"
    return context


@contextlib.contextmanager
def forward_context(context: ForwardContext) -> Iterator[None]:
    token = _CONTEXT.set(context)
    try:
        yield
    finally:
        _CONTEXT.reset(token)
