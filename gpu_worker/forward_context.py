"""Per-step metadata that attention and LoRA layers read, instead of threading it through forward().

The model runner sets it around one forward pass; layers call `get_forward_context()`. A
ContextVar keeps it private to the thread running the engine (tests may run models elsewhere).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kernels import LoRABatchInfo

if TYPE_CHECKING:
    from gpu_worker.kv_cache import KVCache


@dataclass(frozen=True)
class SeqSlice:
    """Where one sequence's new tokens sit in the packed batch and in its KV cache."""
    seq_id: int
    token_start: int    # first row of the sequence's new tokens in the packed batch
    num_new: int        # new tokens this step (whole prompt for prefill, 1 for decode)
    cache_start: int    # tokens already in the cache before this step (= position of the first new token)


@dataclass(frozen=True)
class ForwardContext:
    seqs: tuple[SeqSlice, ...]
    kv_cache: KVCache
    lora: LoRABatchInfo


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
