"""How much the tuned table leaves on a kernel benchmark case: the table's configuration against the
best one kernels.tune's search finds when it times the case's own batches instead of the bucket's
representative ones (kernels/tune.py, `batch_shapes`). A large gap says the representative batches
miss this case; none says the kernel, not the table, holds it back.

It also times the table's static configuration as kernel_bench's atmm_static runs it (an expand on
the static shrink's y), so static / best bounds what any table could show on the case against that
static: the "tuned vs static" target's ceiling. The last lines give the medians over the cases, and over
those where the table's and the static configuration differ (the cases kernel_bench's target counts).

    PYTHONPATH=.:protos python -m benchmarks.tuner_headroom --op shrink \\
        --case "3584 mixed 16 8192 prefill" --case "3584 u16 4 2048 prefill"

A case is "HIDDEN RANKS ADAPTERS TOKENS LAYOUT", as benchmarks/kernel_bench.py names them. Both
configurations are timed as kernel_bench times them (one CUDA graph over rotating copies), and
reported as a fraction of the same roofline: the op's minimum bytes over the device-to-device copy
bandwidth measured in this run.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from multiprocessing import get_context

import torch

from benchmarks import kernel_bench as kb
from kernels import timing, triton_lora, tune, tuning
from kernels.batch import LoRABatch
from kernels.lora_stack import LoRAStack
from kernels.tuning import Config

Timer = Callable[[list[Callable[[], object]]], float]


@dataclass(frozen=True)
class Headroom:
    case: kb.Case
    op: str
    bytes: int
    table_config: Config
    table_s: float
    best_config: Config
    best_s: float
    static_config: Config
    static_s: float  # the static configuration, as kernel_bench's atmm_static runs it

    def line(self, bandwidth: float) -> str:
        def fraction(seconds: float) -> float:
            return self.bytes / bandwidth / seconds
        return (f"{self.op:6s} {self.case.name:34s} table {self.table_s * 1e6:8.2f} us ({fraction(self.table_s):.3f}) "
                f"{_fields(self.table_config)}  best {self.best_s * 1e6:8.2f} us ({fraction(self.best_s):.3f}) "
                f"{_fields(self.best_config)}  table/best {self.table_s / self.best_s:.2f}x  "
                f"static {self.static_s * 1e6:8.2f} us  static/table {self.static_s / self.table_s:.2f}x  "
                f"static/best {self.static_s / self.best_s:.2f}x")


def summary(results: Sequence[Headroom]) -> str:
    """Medians over the cases, then over those where the table's configuration is not the static one:
    what the table shows against the static, and the most any table could."""
    differ = [r for r in results if r.table_config != r.static_config]
    return "\n".join([f"{len(results)} cases: {_medians(results)}",
                      f"{len(differ)} cases where the table's and the static configuration differ: {_medians(differ)}"])


def _medians(results: Sequence[Headroom]) -> str:
    if not results:
        return "-"
    ceiling = [r.static_s / r.best_s for r in results]
    return (f"median table/best {statistics.median(r.table_s / r.best_s for r in results):.2f}x, "
            f"static/table {statistics.median(r.static_s / r.table_s for r in results):.3f}x, "
            f"static/best {statistics.median(ceiling):.3f}x "
            f"({sum(c >= kb.STATIC_SPEEDUP for c in ceiling)} at least {kb.STATIC_SPEEDUP}x)")


def _fields(config: Config) -> str:
    return "(" + ", ".join(str(v) for v in tuning.config_dict(config).values()) + ")"


def parse_case(spec: str) -> kb.Case:
    """'3584 mixed 16 8192 prefill' -> the kernel benchmark's case of that name."""
    try:
        hidden, ranks, adapters, tokens, layout = spec.split()
        return kb.make_case(int(hidden), ranks, int(adapters), int(tokens), layout)
    except (ValueError, AssertionError):
        raise argparse.ArgumentTypeError(
            f"{spec!r}: want 'HIDDEN RANKS ADAPTERS TOKENS LAYOUT', ranks of {list(kb.RANK_SETS)}, "
            f"layout of {list(kb.LAYOUTS)}") from None


def measure_headroom(op: str, case: kb.Case, device: torch.device | str, dtype: torch.dtype, copies: int,
                     timer: Timer = timing.graph_time_s) -> Headroom:
    """Time the table's configuration for the case and run the tuner's search on the case itself.
    Expand reads the y planes of the tuned shrink, as in the benchmark; the static expand, those of
    the static shrink."""
    stack, batches, xs, outs = kb.case_inputs(case, copies, device, dtype)
    ys = [triton_lora.lora_shrink(x, stack, batch) for x, batch in zip(xs, batches)]

    def seconds(config: Config, ys: Sequence[torch.Tensor] = ys) -> tuple[float]:
        calls = [op_call(op, config, stack, *inputs) for inputs in zip(batches, xs, ys, outs)]
        return (timer(calls),)  # one batch shape: the case's

    bucket = tuning.bucket_of(op, stack, batches[0])
    table_config = tuning.lookup(bucket, tuning.table_for(stack.a.device))
    table_s = seconds(table_config)[0]
    entry = tune.search(bucket, seconds, math.inf, on_failure=lambda config, exc: None)
    best_config, best_s = tuning.config_from(op, entry), entry["us"] / 1e6
    if table_s < best_s:  # the search never timed the table's configuration, or timed it slower
        best_config, best_s = table_config, table_s
    static_config = tuning.static_config(op, stack.a.device)
    static_ys = ys  # a shrink reads x only
    if op == "expand":
        static_shrink = tuning.static_config("shrink", stack.a.device)
        static_ys = [triton_lora.lora_shrink(x, stack, batch, static_shrink) for x, batch in zip(xs, batches)]
    static_s = seconds(static_config, static_ys)[0]
    if static_s < best_s:  # a table may hold the static configuration too
        best_config, best_s = static_config, static_s
    return Headroom(case, op, kb.min_bytes(op, case), table_config, table_s, best_config, best_s, static_config,
                    static_s)


def compile_candidates(op: str, spec: str) -> None:
    """Worker: compile the case's stage-1 candidates without launching them (Triton's disk cache
    then has them for the timing), as kernels.tune's workers do for its buckets."""
    case = parse_case(spec)
    stack, batches, xs, outs = kb.case_inputs(case, 1, "cuda", kb.DTYPE)
    inputs = (batches[0], xs[0], triton_lora.lora_shrink(xs[0], stack, batches[0]), outs[0])
    for config in tune.tile_shapes(tuning.bucket_of(op, stack, batches[0])):
        try:
            op_call(op, config, stack, *inputs, compile_only=True)()
        except Exception:  # noqa: BLE001 - out of shared memory and the like: the search skips it too
            pass


def op_call(op: str, config: Config, stack: LoRAStack, batch: LoRABatch, x: torch.Tensor, y: torch.Tensor,
            out: torch.Tensor, compile_only: bool = False) -> Callable[[], object]:
    """One call of `op` with `config` on one copy's inputs (shrink reads x, expand y and out)."""
    if op == "shrink":
        return functools.partial(triton_lora.lora_shrink, x, stack, batch, config, compile_only)
    return functools.partial(triton_lora.lora_expand, out, y, stack, batch, config, compile_only)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", choices=kb.OPS, required=True)
    parser.add_argument("--case", dest="cases", action="append", required=True, metavar="SPEC",
                        help="'HIDDEN RANKS ADAPTERS TOKENS LAYOUT', e.g. '4096 mixed 64 2048 prefill' (repeatable)")
    parser.add_argument("--jobs", type=int, default=max(1, min(15, (os.cpu_count() or 2) - 1)),
                        help="processes compiling candidates ahead of the timing")
    args = parser.parse_args(argv)
    try:
        args.parsed = [parse_case(spec) for spec in args.cases]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tuner_headroom needs a CUDA GPU")
    bandwidth = timing.copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  {datetime.now().isoformat(timespec='seconds')}  "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + written)", flush=True)
    results = []
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        compiled: list[Future] = [pool.submit(compile_candidates, args.op, spec) for spec in args.cases]
        for case, future in zip(args.parsed, compiled):
            future.exception()  # wait; a failed worker only means the timing compiles
            copies = timing.copies_needed(min(kb.min_bytes(op, case) for op in kb.OPS))
            results.append(measure_headroom(args.op, case, kb.DEVICE, kb.DTYPE, copies))
            print(results[-1].line(bandwidth), flush=True)
            torch.cuda.empty_cache()
    print(summary(results), flush=True)


if __name__ == "__main__":
    main()
