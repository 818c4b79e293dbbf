"""Where a prefill-size LoRA expand spends its time over the bytes it must move: a ladder of kernels
walking the same tiles, one ingredient more at each rung, timed at several token counts.

    PYTHONPATH=.:protos python -m benchmarks.expand_ladder --ranks 16 64 128

Rungs (hidden 4096, one adapter, contiguous tokens, out [tokens, hidden] in bf16):
  rmw      out += 1 over [block_m, block_n] tiles, n_steps a program, pipelined loads (the floor-like
           kernel: the bytes of the expand without its y and B)
  product  out += y @ B: y's tile loaded once a program, B's tile each step, the sum on tensor cores
  atmm     kernels.triton_lora.lora_expand with the same tile configuration (batch metadata, masks)
  stationary  lora_expand with B-stationary programs (STATIONARY_CONFIG: one column tile of B held while
           walking 8 M-tiles)
  tuned    lora_expand with the table's configuration for the shape
The lora_expand rungs take y as one bf16 plane, as an unsplit shrink writes it.
Every rung uses programmatic dependent launch as the expand does. Times are kernel_bench's (one CUDA
graph over rotating inputs spanning 3x L2); each rung's time is fitted as fixed + per-token cost, and
reported as a fraction of the roofline: out read and written, y and B once, over the device-to-device
copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from kernels import pdl, timing, triton_lora
from kernels.batch import LoRABatch
from kernels.lora_stack import LoRAStack
from kernels.tuning import ExpandConfig

RUNG_CONFIG = ExpandConfig(32, 128, 4, 4, 3, pipeline=True)  # the H200 table's static expand (again since 2026-11-22)
STATIONARY_CONFIG = ExpandConfig(64, 256, 1, 8, 3, m_steps=8)
RUNGS = ("rmw", "product", "atmm", "stationary", "tuned")
TOKENS = (512, 2048, 4096, 8192)


@triton.jit
def _ladder_kernel(out_ptr, y_ptr, b_ptr, hidden, n_steps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   RANK: tl.constexpr, STAGES: tl.constexpr, PRODUCT: tl.constexpr, PDL: tl.constexpr):
    """out[rows, columns] += y[rows] @ B[:, columns] (PRODUCT) or += 1, over n_steps column steps."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N * n_steps + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, RANK)
    pdl.wait_for_inputs(PDL)
    pdl.start_dependents(PDL)
    out_ptrs = out_ptr + rows[:, None] * hidden + offs_n[None, :]
    b_ptrs = b_ptr + offs_r[:, None] * hidden + offs_n[None, :]
    y = tl.load(y_ptr + rows[:, None] * RANK + offs_r[None, :])
    for _ in tl.range(0, n_steps, num_stages=STAGES):
        prev = tl.load(out_ptrs)
        if PRODUCT:
            acc = tl.dot(y.to(b_ptr.dtype.element_ty), tl.load(b_ptrs), prev.to(tl.float32))
        else:
            acc = prev.to(tl.float32) + 1.0
        tl.store(out_ptrs, acc.to(prev.dtype))
        out_ptrs += BLOCK_N
        b_ptrs += BLOCK_N


def ladder_rung(out: torch.Tensor, y: torch.Tensor, b: torch.Tensor, product: bool, cfg: ExpandConfig) -> None:
    """out [tokens, hidden] (tokens a multiple of block_m, hidden of block_n * n_steps) in b's dtype;
    y [tokens, rank] fp32; b [rank, hidden] (Bᵀ, as stacks store it). y is rounded to b's dtype."""
    tokens, hidden = out.shape
    assert tokens % cfg.block_m == 0 and hidden % (cfg.block_n * cfg.n_steps) == 0, (out.shape, cfg)
    grid = (tokens // cfg.block_m, hidden // (cfg.block_n * cfg.n_steps))
    _ladder_kernel[grid](out, y, b, hidden, cfg.n_steps, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, RANK=y.shape[1],
                         STAGES=cfg.num_stages, PRODUCT=product, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                         **pdl.launch_options(out.device))


def fit(tokens: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """(fixed seconds, seconds per token) of the least-squares line through the timings."""
    per_token, fixed = np.polyfit(tokens, seconds, 1)
    return float(fixed), float(per_token)


def min_bytes(tokens: int, hidden: int, rank: int) -> int:
    """out read and written (bf16), y at the adapter's rank and B once (bf16), as kernel_bench counts them."""
    return 2 * (2 * tokens * hidden + tokens * rank + rank * hidden)


def rung_calls(rung: str, tokens: int, hidden: int, rank: int, device: str) -> list[Callable[[], object]]:
    """One call per rotating copy of the inputs, for timing.graph_time_s."""
    copies = timing.copies_needed(min_bytes(tokens, hidden, rank))
    outs = torch.randn(copies, tokens, hidden, device=device).to(torch.bfloat16)
    ys = torch.randn(copies, 1, tokens, 1, rank, device=device)
    stack = LoRAStack.empty(1, hidden, (hidden,), rank, torch.bfloat16, device)
    stack.b.normal_()
    stack.ranks.fill_(rank)
    stack.scalings.fill_(1.0)
    stack.host_ranks = [[rank]]
    if rung in ("rmw", "product"):
        return [functools.partial(ladder_rung, outs[c], ys[c, 0, :, 0], stack.b[0], rung == "product", RUNG_CONFIG)
                for c in range(copies)]
    batch = LoRABatch.build([tokens], [0], device, max_rank=rank)
    cfg = {"atmm": RUNG_CONFIG, "stationary": STATIONARY_CONFIG}.get(rung)
    ys = ys.to(torch.bfloat16)
    return [functools.partial(triton_lora.lora_expand, outs[c], ys[c], stack, batch, cfg) for c in range(copies)]


def check_product(device: str, dtype: torch.dtype = torch.bfloat16, tokens: int = 64, hidden: int = 1024,
                  rank: int = 64) -> None:
    """The product rung against float32 torch on fresh inputs (a probe, but a wrong one would time nothing)."""
    out = torch.randn(tokens, hidden, device=device).to(dtype)
    y = torch.randn(tokens, rank, device=device)
    b = torch.randn(rank, hidden, device=device).to(dtype)
    want = out.float() + y.to(dtype).float() @ b.float()
    ladder_rung(out, y, b, True, RUNG_CONFIG)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", nargs="+", type=int, default=[16, 64, 128])
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args(argv)
    device = "cuda"
    check_product(device)
    bandwidth = timing.copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; rung tiles {RUNG_CONFIG}")
    print(f"{'rank rung':14s}" + "".join(f"{f't{t} us':>10s}{'frac':>6s}" for t in args.tokens)
          + f"{'fixed us':>10s}{'marginal frac':>15s}{'vs rmw':>8s}")
    for rank in args.ranks:
        rmw_seconds = None  # the first rung's
        for rung in RUNGS:
            seconds = [timing.graph_time_s(rung_calls(rung, t, args.hidden, rank, device)) for t in args.tokens]
            fixed, per_token = fit(args.tokens, seconds)
            rmw_seconds = rmw_seconds or seconds
            cells = "".join(f"{s * 1e6:10.2f}{min_bytes(t, args.hidden, rank) / bandwidth / s:6.2f}"
                            for t, s in zip(args.tokens, seconds))
            marginal = min_bytes(1, args.hidden, 0) / bandwidth / per_token
            print(f"r{rank:<4d}{rung:9s}{cells}{fixed * 1e6:10.2f}{marginal:15.2f}{seconds[-1] / rmw_seconds[-1]:8.2f}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
