"""Decode matmuls of a 7B Llama (Llama-2-7B shapes, bf16): Tessera's skinny Triton kernel against
cuBLAS (F.linear), at the row counts of decode batches, on the GPU it names.

Each op is timed as many calls replayed in one CUDA graph over rotating weight copies spanning
>= 3x L2 (kernels.timing), after a check against a float32 reference on fresh inputs. The floor is
the bytes each call must move (weight, x, out) over the copy bandwidth measured in the same run.
The Triton kernel is timed with programmatic dependent launch (kernels/pdl.py) on and off: in a
graph of back-to-back calls PDL hides each launch behind the previous call's tail, as it does
between the kernels of an engine step.

    PYTHONPATH=.:protos python3 -m benchmarks.linear_bench [--rows 1 16 32 64] [--shapes o down] [--sweep] [--json OUT]
    PYTHONPATH=.:protos python3 -m benchmarks.linear_bench --lora [--rows 1 8 32] [--json OUT]

--sweep also times a grid of tile configurations for each shape and row count and prints the best.
--lora times a LoRA layer's projection (rank-64 adapters on every slice; each row its own adapter, or
all rows one adapter): the shrink, the skinny matmul and kernels.lora_expand (the table's
configurations), against the shrink and the matmul with the expand fused in, whether or not
kernels.linear_with_lora would fuse that batch (its choice is printed). The floor adds the A and B
weights the step uses to the matmul's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import product
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import LoRABatch, LoRAStack, pdl, triton_lora
from kernels.timing import copies_needed, copy_bandwidth, graph_time_s
from kernels.triton_linear import LinearConfig, LoRAOperand, fuses_lora, linear_config, row_tile, skinny_linear

# (name, out_features, in_features) of the Llama-2-7B decode matmuls; per step each layer's four
# run 32 times and lm_head once.
SHAPES = (("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008),
          ("lm_head", 32000, 4096))
LAYERS = 32
ROWS = (1, 8, 16, 32, 48, 64)
SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_WARPS, SWEEP_STAGES = (16, 32, 64, 128), (128, 256, 512), (2, 4), (3, 4)
SMEM_BYTES = 227 * 1024  # an H100/H200 block's shared memory
SLICES = {"qkv": (4096, 4096, 4096), "o": (4096,), "gate_up": (11008, 11008), "down": (4096,)}  # LoRA output slices
LORA_RANK = 64


@contextmanager
def pdl_setting(on: bool) -> Iterator[None]:
    before = os.environ.get(pdl.ENV_VAR)
    os.environ[pdl.ENV_VAR] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[pdl.ENV_VAR]
        else:
            os.environ[pdl.ENV_VAR] = before


def check(rows: int, out_features: int, in_features: int, config: LinearConfig | None) -> None:
    """Triton and cuBLAS against float32 on fresh random inputs (bf16 operands: ~1e-2 relative)."""
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
    want = x.float() @ w.float().t()
    for got in (skinny_linear(x, w, None, config), F.linear(x, w)):
        err = (got.float() - want).norm() / want.norm()
        assert err < 1e-2, f"{rows}x{in_features}->{out_features} {config}: relative error {err:.2e}"


def time_op(rows: int, out_features: int, in_features: int,
            op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
    """Seconds per call of op(x, w) over rotating weight copies."""
    weight_bytes = out_features * in_features * 2
    copies = copies_needed(weight_bytes)
    ws = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    xs = [torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    seconds = graph_time_s([lambda x=x, w=w: op(x, w) for x, w in zip(xs, ws)])
    del ws, xs
    return seconds


def fits(rows: int, cfg: LinearConfig) -> bool:
    """Whether the config's pipelined x and W tiles fit one program's shared memory."""
    return (row_tile(rows) * cfg.block_k + cfg.block_k * cfg.block_n) * 2 * cfg.num_stages <= SMEM_BYTES


def sweep(rows: int, out_features: int, in_features: int) -> list[tuple[float, LinearConfig]]:
    configs = [LinearConfig(n, k, w, s) for n, k, w, s in product(SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_WARPS,
                                                                  SWEEP_STAGES)]
    timed = []
    for cfg in filter(lambda c: fits(rows, c), configs):
        check(rows, out_features, in_features, cfg)
        timed.append((time_op(rows, out_features, in_features,
                              lambda x, w, cfg=cfg: skinny_linear(x, w, None, cfg)), cfg))
    return sorted(timed, key=lambda t: t[0])


def lora_case(rows: int, name: str, own: bool) -> list[tuple[torch.Tensor, torch.Tensor, LoRAOperand]]:
    """Rotating (x, weight, LoRA operand) copies: rank-64 adapters on every slice of `name`, in `rows`
    slots (own: row i uses slot i) or one; y computed by the shrink, as a step would have it."""
    sizes, in_features = SLICES[name], dict((n, k) for n, _, k in SHAPES)[name]
    slots = rows if own else 1
    used_bytes = (sum(sizes) * in_features + slots * LORA_RANK * (sum(sizes) + in_features * len(sizes))) * 2
    copies = []
    for _ in range(copies_needed(used_bytes)):
        stack = LoRAStack.empty(slots, in_features, sizes, LORA_RANK, torch.bfloat16, "cuda")
        for slot in range(slots):
            stack.set_slot(slot, {s: (torch.randn(LORA_RANK, in_features, device="cuda", dtype=torch.bfloat16) * 0.02,
                                      torch.randn(n, LORA_RANK, device="cuda", dtype=torch.bfloat16) * 0.02)
                                  for s, n in enumerate(sizes)}, 2.0)
        batch = LoRABatch.build([1] * rows if own else [rows], list(range(rows)) if own else [0], "cuda",
                                max_rank=LORA_RANK)
        x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(sum(sizes), in_features, device="cuda", dtype=torch.bfloat16) * 0.02
        copies.append((x, weight, stack, batch))
    return copies


def unfused(x: torch.Tensor, weight: torch.Tensor, stack: LoRAStack, batch: LoRABatch) -> torch.Tensor:
    """The shrink, the skinny matmul, the expand: three launches."""
    y = triton_lora.lora_shrink(x, stack, batch)
    out = skinny_linear(x, weight)
    triton_lora.lora_expand(out, y, stack, batch)
    return out


def fused(x: torch.Tensor, weight: torch.Tensor, stack: LoRAStack, batch: LoRABatch) -> torch.Tensor:
    """The shrink, then the matmul with the expand inside (as linear_with_lora runs it where it fuses)."""
    return skinny_linear(x, weight, lora=LoRAOperand(triton_lora.lora_shrink(x, stack, batch), stack, batch))


def lora_rows(rows: int, name: str, own: bool, bandwidth: float) -> dict:
    """One case: both paths checked against float32, then timed; a row of the report."""
    copies = lora_case(rows, name, own)
    x, weight, stack, batch = copies[0]
    want = x.float() @ weight.float().t()
    for s, (lo, hi) in enumerate(zip(stack.out_offsets, stack.out_offsets[1:])):
        for token, slot in enumerate(range(rows) if own else [0] * rows):
            a, b = stack.a[slot, s].float(), stack.b[slot, :, lo:hi].float()
            want[token, lo:hi] += stack.scalings[slot] * (x[token].float() @ a.t()) @ b
    for label, got in (("unfused", unfused(*copies[0])), ("fused", fused(*copies[0]))):
        err = ((got.float() - want).norm() / want.norm()).item()
        assert err < 1e-2, f"{name} rows {rows} {label}: relative error {err:.2e}"
    n, k = weight.shape
    slots = rows if own else 1
    floor = (n * k + slots * LORA_RANK * (n + k * stack.num_slices) + rows * (n + k)) * 2 / bandwidth
    times = {label: graph_time_s([lambda c=c, op=op: op(*c) for c in copies])
             for label, op in (("base", lambda x, w, stack, batch: skinny_linear(x, w)), ("unfused", unfused),
                               ("fused", fused))}
    del copies
    return dict(shape=name, rows=rows, adapters="own" if own else "one", engine_fuses=fuses_lora(stack, batch),
                floor_us=floor * 1e6,
                **{f"{label}_us": t * 1e6 for label, t in times.items()})


def lora_report(row_counts: Sequence[int], shapes: Sequence[str], bandwidth: float) -> list[dict]:
    print(f"{'shape':<8} {'rows':>4} {'adapters':>8} {'floor us':>9} {'base':>8} {'unfused':>8} {'fused':>8} "
          f"{'unfused/fused':>13} {'fused frac':>10}  engine fuses", flush=True)
    report = []
    for rows in row_counts:
        for own in (True, False):
            for name in (s for s in SLICES if s in shapes):
                row = lora_rows(rows, name, own, bandwidth)
                report.append(row)
                print(f"{name:<8} {rows:>4} {row['adapters']:>8} {row['floor_us']:>9.1f} {row['base_us']:>8.1f} "
                      f"{row['unfused_us']:>8.1f} {row['fused_us']:>8.1f} {row['unfused_us'] / row['fused_us']:>13.3f} "
                      f"{row['floor_us'] / row['fused_us']:>10.3f}  {row['engine_fuses']}", flush=True)
    print("\nper decode step (32 layers x the shapes above), ms:")
    for rows in row_counts:
        for adapters in ("own", "one"):
            mine = [r for r in report if r["rows"] == rows and r["adapters"] == adapters]
            totals = {key: sum(r[key] for r in mine) * LAYERS / 1e3
                      for key in ("floor_us", "base_us", "unfused_us", "fused_us")}
            print(f"  rows {rows:>3}, {adapters} adapters: floor {totals['floor_us']:.3f}  base {totals['base_us']:.3f}  "
                  f"unfused {totals['unfused_us']:.3f}  fused {totals['fused_us']:.3f}  "
                  f"unfused/fused {totals['unfused_us'] / totals['fused_us']:.3f}", flush=True)
    return report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--shapes", nargs="+", choices=[name for name, _, _ in SHAPES],
                        default=[name for name, _, _ in SHAPES])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tile configurations")
    parser.add_argument("--lora", action="store_true", help="time the matmul plus a LoRA expand, apart and fused")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    device = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    print(f"{device}; torch {torch.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    if args.lora:
        report = lora_report(args.rows, args.shapes, bandwidth)
        if args.json:
            args.json.write_text(json.dumps({"device": device, "torch": torch.__version__,
                                             "copy_bandwidth_Bps": bandwidth, "lora_rows": report}, indent=1))
        return
    print(f"{'shape':<8} {'rows':>4} {'floor us':>9} {'cublas':>8} {'triton':>8} {'no PDL':>8} "
          f"{'cublas/triton':>13} {'triton frac':>11}  sweep best", flush=True)
    rows_out = []
    for rows in args.rows:
        for name, n, k in (shape for shape in SHAPES if shape[0] in args.shapes):
            check(rows, n, k, None)
            floor = (n * k + rows * (n + k)) * 2 / bandwidth
            cublas = time_op(rows, n, k, F.linear)
            with pdl_setting(True):
                triton_pdl = time_op(rows, n, k, skinny_linear)
            with pdl_setting(False):
                triton_plain = time_op(rows, n, k, skinny_linear)
            best = sweep(rows, n, k)[:3] if args.sweep else []
            row = dict(shape=name, rows=rows, floor_us=floor * 1e6, cublas_us=cublas * 1e6,
                       triton_us=triton_pdl * 1e6, triton_no_pdl_us=triton_plain * 1e6,
                       config=vars(linear_config(rows, n, k)),
                       sweep=[dict(us=s * 1e6, **vars(c)) for s, c in best])
            rows_out.append(row)
            best_text = "  ".join(f"{s * 1e6:.1f}us {c.block_n}/{c.block_k}/{c.num_warps}w/{c.num_stages}s"
                                  for s, c in best)
            print(f"{name:<8} {rows:>4} {floor * 1e6:>9.1f} {cublas * 1e6:>8.1f} {triton_pdl * 1e6:>8.1f} "
                  f"{triton_plain * 1e6:>8.1f} {cublas / triton_pdl:>13.3f} {floor / triton_pdl:>11.3f}  {best_text}",
                  flush=True)
    print("\nper decode step (32 layers x the shapes above, lm_head once), ms:")
    for rows in args.rows:
        mine = [r for r in rows_out if r["rows"] == rows]
        totals = {key: sum(r[key] * (1 if r["shape"] == "lm_head" else LAYERS) for r in mine) / 1e3
                  for key in ("floor_us", "cublas_us", "triton_us", "triton_no_pdl_us")}
        print(f"  rows {rows:>3}: floor {totals['floor_us']:.3f}  cublas {totals['cublas_us']:.3f}  "
              f"triton {totals['triton_us']:.3f} (no PDL {totals['triton_no_pdl_us']:.3f})  "
              f"cublas/triton {totals['cublas_us'] / totals['triton_us']:.3f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": device, "torch": torch.__version__,
                                         "copy_bandwidth_Bps": bandwidth, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
