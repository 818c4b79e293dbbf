"""A tiny real GPU tier (one LoRALinear on CPU) and a fake disk for the adapter manager's unit tests."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable

import torch

import kernels
from gpu_worker.lora.adapter_manager import AdapterManager
from gpu_worker.lora.gpu_memory import GpuAdapterMemory
from gpu_worker.lora.layer import LoRALinear
from gpu_worker.lora.loader import AdapterRef, LoRAModule, LoRAWeights
from policy.eviction import LRU, Eviction

IN, OUT, MAX_RANK = 8, 6, 4


def tiny_memory(num_slots: int, device: str = "cpu", dtype: torch.dtype = torch.float32
                ) -> tuple[GpuAdapterMemory, LoRALinear]:
    module = LoRALinear(IN, (OUT,), bias=False).to(device, dtype)
    arena = kernels.AdapterArena(num_slots * module.slot_elems([MAX_RANK]), dtype, device)
    module.init_slots(num_slots, MAX_RANK, arena)
    return GpuAdapterMemory({(0, "q_proj"): (module, 0)}, arena, MAX_RANK), module


def installed(module: LoRALinear, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, IN], B [OUT, r]) of the adapter in `slot`, as the kernels read them."""
    return module.lora.slot_weights(slot)[0]


def ref(name: str, version: int = 0, rank: int = MAX_RANK) -> AdapterRef:
    digest = hashlib.sha256(f"{name}/v{version}".encode()).hexdigest()
    return AdapterRef(name, "base", rank, digest, f"/store/{digest}")


class Disk:
    """`read` for the manager: fresh random weights per version (the same ones for every read of it),
    counting reads; reads of digests in `held` wait until `release`; `broken` digests raise."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.threads: list[str] = []  # the thread of each read
        self.weights: dict[str, LoRAWeights] = {}
        self.broken: dict[str, Exception] = {}
        self._held: dict[str, threading.Event] = {}

    def hold(self, adapter: AdapterRef) -> None:
        self._held[adapter.sha256] = threading.Event()

    def release(self, adapter: AdapterRef) -> None:
        self._held.pop(adapter.sha256).set()

    def read(self, adapter: AdapterRef) -> LoRAWeights:
        self.reads.append(adapter.name)
        self.threads.append(threading.current_thread().name)
        if (gate := self._held.get(adapter.sha256)) is not None:
            assert gate.wait(10), "held read never released"
        if adapter.sha256 in self.broken:
            raise self.broken[adapter.sha256]
        if adapter.sha256 not in self.weights:
            a, b = torch.randn(adapter.rank, IN), torch.randn(OUT, adapter.rank)
            self.weights[adapter.sha256] = LoRAWeights(adapter.name, {(0, "q_proj"): LoRAModule(a, b, 0.5)})
        return self.weights[adapter.sha256]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def manager(num_slots: int, disk: Disk, *, host_slots: int | None = None, eviction: Eviction | None = None,
            clock: Callable[[], float] = time.monotonic) -> tuple[AdapterManager, LoRALinear]:
    """A manager over `num_slots` GPU slots of one projection and a host tier of `host_slots`
    adapters (default 4x); failures are remembered 10 s."""
    memory, module = tiny_memory(num_slots)
    adapters = AdapterManager(memory, disk.read, host_bytes=(host_slots or 4 * num_slots) * memory.max_bytes,
                              host_page_bytes=memory.max_bytes,  # a page per adapter, as the slots counted
                              loader_threads=2, eviction=eviction or LRU(), failure_ttl_s=10.0, clock=clock)
    return adapters, module


def poll_until(adapters: AdapterManager, done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll as the scheduler does, pass after pass, until `done()`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out polling the adapter manager"
        adapters.poll()
        time.sleep(0.001)
