"""Decode matmuls of a 7B Llama (Llama-2-7B shapes, bf16): Tessera's skinny Triton kernel against
cuBLAS (F.linear), at the row counts of decode batches, on the GPU it names.

Each op is timed as many calls replayed in one CUDA graph over rotating weight copies spanning
>= 3x L2 (kernels.tuner.timing), after a check against a float32 reference on fresh inputs. The floor is
the bytes each call must move (weight, x, out) over the copy bandwidth measured in the same run.
The Triton kernel is timed with programmatic dependent launch (kernels/triton/pdl.py) on and off: in a
graph of back-to-back calls PDL hides each launch behind the previous call's tail, as it does
between the kernels of an engine step.

    PYTHONPATH=.:protos python3 -m benchmarks.linear_bench [--rows 1 16 32 64] [--shapes o down] [--sweep] [--json OUT]

--sweep also times a grid of tile configurations for each shape and row count and prints the best.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import product
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness.cli import suite_parser
from benchmarks.harness.report import write_json
from kernels.triton import pdl
from kernels.triton.linear import LinearConfig, linear_config, row_tile, skinny_linear
from kernels.tuner.timing import copies_needed, copy_bandwidth, graph_time_s

# (name, out_features, in_features) of the Llama-2-7B decode matmuls; per step each layer's four
# run 32 times and lm_head once.
SHAPES = (("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008),
          ("lm_head", 32000, 4096))
LAYERS = 32
ROWS = (1, 8, 16, 32, 48, 64)
SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_WARPS, SWEEP_STAGES = (16, 32, 64, 128), (128, 256, 512), (2, 4), (3, 4)
SMEM_BYTES = 227 * 1024  # an H100/H200 block's shared memory


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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = suite_parser(__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--shapes", nargs="+", choices=[name for name, _, _ in SHAPES],
                        default=[name for name, _, _ in SHAPES])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tile configurations")
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    device = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    print(f"{device}; torch {torch.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
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
    report = {"device": device, "torch": torch.__version__, "copy_bandwidth_Bps": bandwidth, "rows": rows_out}
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
