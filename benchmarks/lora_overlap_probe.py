"""Would side streams shorten a decode step's LoRA? The q,k,v,o projections of 32 layers of a
7B shape at batch 32, every token on its own rank-64 adapter (issue 3's case (c)), replayed in one
CUDA graph: base matmuls alone, LoRA alone, both in sequence (what the engine does), the shrink on a
side stream concurrent with the base matmul, and shrink + expand on the side stream into a buffer
added after the join. Each variant is checked against the sequential one first.

    PYTHONPATH=.:protos python3 benchmarks/lora_overlap_probe.py

Result on an H200 (docs/benchmarks/engine.md): overlap saves 5.5-6% of these projections' time,
about 0.18 ms of a 6.9 ms step, so the engine keeps one stream.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

import kernels
from kernels import triton_lora
from kernels.timing import copy_bandwidth, graph_time_s

LAYERS, HIDDEN, TOKENS, RANK = 32, 4096, 32, 64
DTYPE = torch.bfloat16
Projection = tuple[torch.Tensor, kernels.LoRAStack]


def projection(out_sizes: list[int]) -> Projection:
    """A base weight and a stack with one rank-RANK adapter per token's slot, on every slice."""
    weight = torch.randn(sum(out_sizes), HIDDEN, dtype=DTYPE, device="cuda") * 0.02
    stack = kernels.LoRAStack.empty(TOKENS, HIDDEN, out_sizes, RANK, DTYPE, "cuda")
    for slot in range(TOKENS):
        stack.set_slot(slot, {s: (torch.randn(RANK, HIDDEN, dtype=DTYPE, device="cuda") * 0.02,
                                  torch.randn(n, RANK, dtype=DTYPE, device="cuda") * 0.02)
                              for s, n in enumerate(out_sizes)}, 0.5)
    return weight, stack


def main() -> None:
    torch.manual_seed(0)
    layers = [(projection([HIDDEN] * 3), projection([HIDDEN])) for _ in range(LAYERS)]
    x = torch.randn(TOKENS, HIDDEN, dtype=DTYPE, device="cuda")
    batch = kernels.LoRABatch.build([1] * TOKENS, list(range(TOKENS)), "cuda", max_rank=RANK)
    side = torch.cuda.Stream()

    def sequential(weight: torch.Tensor, stack: kernels.LoRAStack) -> torch.Tensor:
        out = kernels.linear(x, weight, None)
        triton_lora.lora_expand(out, triton_lora.lora_shrink(x, stack, batch), stack, batch)
        return out

    def shrink_beside(weight: torch.Tensor, stack: kernels.LoRAStack) -> torch.Tensor:
        main_stream = torch.cuda.current_stream()
        side.wait_stream(main_stream)
        with torch.cuda.stream(side):
            y = triton_lora.lora_shrink(x, stack, batch)
        out = kernels.linear(x, weight, None)
        main_stream.wait_stream(side)
        triton_lora.lora_expand(out, y, stack, batch)
        return out

    def lora_beside(weight: torch.Tensor, stack: kernels.LoRAStack) -> torch.Tensor:
        main_stream = torch.cuda.current_stream()
        side.wait_stream(main_stream)
        with torch.cuda.stream(side):
            delta = torch.zeros(TOKENS, weight.shape[0], dtype=DTYPE, device="cuda")
            triton_lora.lora_expand(delta, triton_lora.lora_shrink(x, stack, batch), stack, batch)
        out = kernels.linear(x, weight, None)
        main_stream.wait_stream(side)
        return out.add_(delta)

    def every_layer(proj: Callable[[torch.Tensor, kernels.LoRAStack], object]) -> Callable[[], None]:
        def step() -> None:
            for qkv, o in layers:
                proj(*qkv)
                proj(*o)
        return step

    def base(weight: torch.Tensor, stack: kernels.LoRAStack) -> None:
        kernels.linear(x, weight, None)

    def lora(weight: torch.Tensor, stack: kernels.LoRAStack) -> None:
        out = torch.empty(TOKENS, weight.shape[0], dtype=DTYPE, device="cuda")
        triton_lora.lora_expand(out, triton_lora.lora_shrink(x, stack, batch), stack, batch)

    for variant in (shrink_beside, lora_beside):
        for qkv, o in layers[:2]:
            for weight, stack in (qkv, o):
                expected, actual = sequential(weight, stack), variant(weight, stack)
                torch.cuda.synchronize()
                assert torch.allclose(actual.float(), expected.float(), atol=2e-2, rtol=2e-2), variant.__name__
    bandwidth = copy_bandwidth()
    weight_bytes = sum(w.numel() * 2 for pair in layers for w, _ in pair)
    adapter_bytes = sum((st.a.numel() + st.b.numel()) * 2 for pair in layers for _, st in pair)
    floor = (weight_bytes + adapter_bytes) / bandwidth
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s; base {weight_bytes / 1e9:.2f} GB, "
          f"adapters {adapter_bytes / 1e9:.2f} GB; floor {floor * 1e3:.3f} ms (base {weight_bytes / bandwidth * 1e3:.3f})")
    for name, proj in [("base", base), ("lora only", lora), ("sequential", sequential),
                       ("shrink overlapped", shrink_beside), ("shrink+expand overlapped, add", lora_beside)]:
        seconds = graph_time_s([every_layer(proj)], repeats=5, min_calls=2)
        print(f"{name:32s} {seconds * 1e3:7.3f} ms  x floor {seconds / floor:.2f}", flush=True)


if __name__ == "__main__":
    main()
