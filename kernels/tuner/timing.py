"""Timing GPU ops the way the tuner and the kernel benchmark both need: many calls replayed in one
CUDA graph (no launch gaps between them) over rotating copies of the inputs whose bytes add up to
at least 3x the L2 cache (no call finds its inputs left in L2 by the one before).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch

L2_MULTIPLE = 3  # rotating inputs span at least this many L2 caches
MIN_CALLS = 32   # calls per graph: amortizes the graph launch for microsecond ops


def l2_bytes(device: torch.device | None = None) -> int:
    return torch.cuda.get_device_properties(device or torch.cuda.current_device()).L2_cache_size


def copies_needed(bytes_per_copy: int, device: torch.device | None = None) -> int:
    """Input copies to rotate through so that together they span L2_MULTIPLE L2 caches."""
    return max(1, math.ceil(L2_MULTIPLE * l2_bytes(device) / max(bytes_per_copy, 1)))


def graph_time_s(calls: list[Callable[[], object]], repeats: int = 5, min_calls: int = MIN_CALLS) -> float:
    """Median seconds per call: `calls` (one per input copy) cycled until at least `min_calls`,
    captured in one CUDA graph, replayed `repeats` times after a warm-up replay."""
    assert calls, "nothing to time"
    sequence = [calls[i % len(calls)] for i in range(max(min_calls, len(calls)))]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture (copies share the kernel)
        calls[0]()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in sequence:
            call()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(sequence))
    del graph
    return statistics.median(times)


def copy_bandwidth(num_bytes: int = 2**31, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written. Timed with
    events, not in a graph: a graph's memcpy node may run on a copy engine, measured markedly slower
    than the copy kernel."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times)
