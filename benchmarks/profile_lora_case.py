"""Run the tuned shrink and expand of kernel benchmark cases a few times, untimed: a target for a
profiler. The first run of each op compiles it; profile the later ones, for example

    PYTHONPATH=.:protos ncu --clock-control none -k regex:"_expand_kernel|_shrink_kernel" \\
        --launch-skip 2 --launch-count 2 --section WarpStateStats \\
        python3 -m benchmarks.profile_lora_case "4096 mixed 64 2048 prefill"

A case is "HIDDEN RANKS ADAPTERS TOKENS LAYOUT" (benchmarks/tuner_headroom.py); its inputs are the
kernel benchmark's first copy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from benchmarks import kernel_bench as kb
from benchmarks.tuner_headroom import parse_case
from kernels import triton_lora


def run(case: kb.Case, repeats: int, device: torch.device | str = kb.DEVICE, dtype: torch.dtype = kb.DTYPE) -> None:
    stack, batches, xs, outs = kb.case_inputs(case, 1, device, dtype)
    for _ in range(repeats):
        y = triton_lora.lora_shrink(xs[0], stack, batches[0])
        triton_lora.lora_expand(outs[0], y, stack, batches[0])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+", type=parse_case, metavar="CASE")
    parser.add_argument("--repeats", type=int, default=2, help="runs of shrink then expand per case")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_lora_case needs a CUDA GPU")
    for case in args.cases:
        run(case, args.repeats)
        torch.cuda.synchronize()
        print("ran", case.name, flush=True)


if __name__ == "__main__":
    main()
