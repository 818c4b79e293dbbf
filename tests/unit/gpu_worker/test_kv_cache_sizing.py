"""How many KV blocks a CUDA worker takes (kv_cache.cuda_blocks_that_fit), with the device's memory
queries faked: the arithmetic and the errors run on CPU."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kv_cache import CacheShape, cuda_blocks_that_fit

GIB = 2**30
SHAPE = CacheShape(num_layers=32, num_kv_heads=32, head_dim=128, dtype=torch.bfloat16, device=torch.device("cpu"))
BLOCK = 16  # tokens; a block of this shape is 8 MiB (K and V, 32 layers)


def fake_device(monkeypatch, *, total: float, free: float, reserved: float, allocated: float) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free * GIB), int(total * GIB)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(reserved * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: int(allocated * GIB))


def test_blocks_fill_the_share_of_the_device_left_after_the_peak(monkeypatch):
    # 80 GiB device, the process alone on it: 14 GiB of weights allocated, a 16 GiB peak.
    fake_device(monkeypatch, total=80, free=80 - 14.5, reserved=14, allocated=14)
    blocks = cuda_blocks_that_fit(SHAPE, BLOCK, 0.9, peak_bytes=16 * GIB)
    assert blocks == int((0.9 * 80 - 16) * GIB) // SHAPE.bytes_per_block(BLOCK)
    assert blocks * SHAPE.bytes_per_block(BLOCK) + 2 * GIB <= (80 - 14.5) * GIB  # it and the activations fit


def test_memory_held_elsewhere_fails_with_the_numbers_not_out_of_memory(monkeypatch):
    # Another process holds 30 GiB: 0.9 of the device would overcommit it.
    fake_device(monkeypatch, total=80, free=80 - 14.5 - 30, reserved=14, allocated=14)
    with pytest.raises(RuntimeError, match="does not fit") as error:
        cuda_blocks_that_fit(SHAPE, BLOCK, 0.9, peak_bytes=16 * GIB)
    message = str(error.value)
    assert "35.50 GiB of the device's 80.00 GiB are free" in message
    assert "other processes and the CUDA context 30.50 GiB" in message
    assert "gpu_memory_utilization" in message and "kv_cache_tokens" in message
    # A share that leaves room for the other process fits.
    blocks = cuda_blocks_that_fit(SHAPE, BLOCK, 0.5, peak_bytes=16 * GIB)
    assert blocks * SHAPE.bytes_per_block(BLOCK) + 2 * GIB <= 35.5 * GIB


def test_a_share_smaller_than_the_peak_leaves_no_room(monkeypatch):
    fake_device(monkeypatch, total=80, free=65, reserved=14, allocated=14)
    with pytest.raises(RuntimeError, match="no room for a KV cache"):
        cuda_blocks_that_fit(SHAPE, BLOCK, 0.2, peak_bytes=16 * GIB)
