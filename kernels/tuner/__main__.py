"""`python -m kernels.tuner`: time the LoRA kernels' tile configurations per shape bucket on this GPU
and write the table kernels/tiling.py looks up (kernels/tables/<gpu>.json).

    python -m kernels.tuner --model llama-7b qwen2-7b --dry-run   # buckets, candidate counts; no GPU
    python -m kernels.tuner --model llama-7b --time-budget 500    # stops cleanly, keeps what is done
    python -m kernels.tuner --model llama-7b --skip-tuned         # goes on where a budgeted run stopped

How a bucket is tuned: kernels/tuner/__init__.py.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from datetime import date
from multiprocessing import get_context
from pathlib import Path
from typing import TextIO

import torch
import triton

from kernels import tiling
from kernels.tiling import Bucket, Config
from kernels.tuner.buckets import OPS, PRESETS, PROJECTIONS, buckets, model_shape
from kernels.tuner.candidates import STAGES, WARPS, tile_shapes
from kernels.tuner.search import SHORTLIST, BudgetSpent, CheckFailed, first_line, search
from kernels.tuner.table_io import (expands_on_heuristic_splits, merged_table, read_table, shrink_splits, untuned,
                                    write_table)
from kernels.tuner.workload import Workload, compile_candidates, rotation_copies


class Progress:
    """`[done/total] elapsed, ETA  current item` on stderr: redrawn in place on a terminal, one line
    per update otherwise (logs). Notes print above it."""

    def __init__(self, total: int, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.total, self.stream, self.clock = total, stream or sys.stderr, clock
        self.start, self.line, self.tty = clock(), "", self.stream.isatty()

    def show(self, done: int, label: str) -> None:
        elapsed = self.clock() - self.start
        eta = _hms(elapsed / done * (self.total - done)) if done else "?"
        self.line = f"[{done}/{self.total}] {_hms(elapsed)} elapsed, ETA {eta}  {label}"
        self.stream.write(f"\r\x1b[K{self.line}" if self.tty else f"{self.line}\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        self.stream.write(f"\r\x1b[K{text}\n{self.line}" if self.tty else f"{text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def print_plan(todo: Sequence[Bucket]) -> None:
    """--dry-run: each bucket's timings (stage 1 with the heuristic; stage 2 at most), and totals."""
    total1 = total2 = 0
    for bucket in todo:
        stage1 = tile_shapes(bucket)
        n1 = len(stage1) + (tiling.heuristic_config(bucket) not in stage1)
        n2 = (len(WARPS) * len(STAGES[bucket.op]) - 1) * min(SHORTLIST, len(stage1))  # less stage 1's setting
        total1, total2 = total1 + n1, total2 + n2
        print(f"{bucket.key}  stage1 {n1}  stage2 <={n2}")
    per_op = ", ".join(f"{op} {sum(b.op == op for b in todo)}" for op in OPS)
    print(f"{len(todo)} buckets ({per_op}); timings: stage 1 {total1}, stage 2 <={total2}")


def tune(args: argparse.Namespace, todo: list[Bucket], command: str) -> int:
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    path = args.table or tiling.TABLE_DIR / f"{tiling.gpu_slug(gpu)}.json"
    old = read_table(path) if args.merge else None
    if old and (old.get("triton"), old.get("torch")) != (triton.__version__, torch.__version__):
        print(f"note: merging into {path}, tuned with triton {old.get('triton')}, torch {old.get('torch')}",
              file=sys.stderr)
    if args.skip_tuned:
        todo = untuned(todo, old)
    if heuristic_splits := expands_on_heuristic_splits(todo, old):
        print(f"note: {len(heuristic_splits)} expand buckets have no shrink entry in {path}: they are timed on the "
              "heuristic shrink's K split; merge this table whole, not entry by entry", file=sys.stderr)
    header = {"gpu": gpu, "capability": tiling.capability_of(torch.cuda.current_device()),  # kin GPUs use it
              "triton": triton.__version__, "torch": torch.__version__,
              "date": date.today().isoformat(), "command": command}
    dtype = getattr(torch, args.dtype)
    elem_size = torch.empty((), dtype=dtype).element_size()
    progress = Progress(len(todo))
    failures: dict[str, int] = {}  # distinct failure note -> count: each is printed once

    def on_failure(config: Config, exc: Exception) -> None:
        note = f"skipped {config}: {first_line(exc)}"
        if note not in failures:
            progress.note(note)
        failures[note] = failures.get(note, 0) + 1

    def tune_bucket(bucket: Bucket) -> bool:
        """Time `bucket` into `new` (or `broken`); False once the time budget is spent."""
        splits = shrink_splits(bucket, old, new)
        work = Workload.build(bucket, rotation_copies(bucket, elem_size, splits), dtype, device, splits=splits)
        try:
            work.check(tiling.heuristic_config(bucket))  # a broken kernel is never tuned
            new[bucket.key] = search(bucket, work.seconds, deadline, on_failure)
        except CheckFailed as exc:
            broken.append(bucket.key)
            progress.note(f"NOT TUNED {exc}")
        except BudgetSpent:
            return False
        finally:
            del work
            torch.cuda.empty_cache()
        return True

    deadline = time.monotonic() + args.time_budget
    new: dict[str, dict] = {}
    broken: list[str] = []
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        for op in OPS:  # all shrink buckets first: each expand is tuned on its shrink's splits
            op_todo = [b for b in todo if b.op == op]
            if time.monotonic() > deadline:
                break
            # Workers compile each bucket's candidates ahead of the timing, which then finds them
            # in Triton's on-disk cache: compiling, not timing, is most of a tuning run.
            compiled = {b: pool.submit(compile_candidates, b, args.dtype, shrink_splits(b, old, new)) for b in op_todo}
            try:
                for bucket in op_todo:
                    if time.monotonic() > deadline:
                        break
                    progress.show(len(new) + len(broken), bucket.key)
                    if compiled[bucket].exception() is not None:  # a dead worker: the timing compiles
                        progress.note(f"compiling ahead failed for {bucket.key}: {first_line(compiled[bucket].exception())}")
                    if not tune_bucket(bucket):
                        break
                    write_table(path, merged_table(old, new, header))
            finally:
                for future in compiled.values():
                    future.cancel()
    left = len(todo) - len(new) - len(broken)
    progress.show(len(todo) - left, "stopped: time budget spent" if left else "done")
    progress.close()
    print(f"tuned {len(new)} of {len(todo)} buckets on {gpu}"
          + (f"; {left} left: time budget spent, go on with --skip-tuned" if left else ""))
    print_summary(path, new, broken, failures)
    return 1 if broken else 0


def print_summary(path: Path, new: dict[str, dict], broken: list[str], failures: dict[str, int]) -> None:
    if new:
        speedups = [e["heuristic_us"] / e["us"] for e in new.values()]
        print(f"winner vs heuristic: median speedup {statistics.median(speedups):.2f}x, max {max(speedups):.2f}x")
        table = read_table(path)
        for op, config in table["static"].items():
            print(f"static {op}: {config}")
        print(f"wrote {path} ({len(table['configs'])} buckets)")
    if failures:
        print(f"{sum(failures.values())} timings skipped ({len(failures)} distinct failures, on stderr)")
    if broken:
        print(f"CHECK FAILED, not tuned ({len(broken)}): {' '.join(broken)}")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kernels.tuner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", required=True, metavar="NAME|PATH",
                        help=f"presets ({', '.join(PRESETS)}) or local HF model directories / config.json files")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--projections", nargs="+", choices=PROJECTIONS, default=list(PROJECTIONS))
    parser.add_argument("--ranks", nargs="+", type=int, default=list(tiling.RANK_POINTS),
                        help="rank tiles to tune, of tiling.RANK_POINTS (default: all)")
    parser.add_argument("--tokens", nargs="+", type=int, default=list(tiling.TOKEN_POINTS),
                        help="batch sizes T to tune, of tiling.TOKEN_POINTS (default: all)")
    parser.add_argument("--groups", nargs="+", type=int, default=list(tiling.TOKEN_POINTS),
                        help="largest-group sizes G to tune, of tiling.TOKEN_POINTS (default: all)")
    parser.add_argument("--mixed", action="store_true",
                        help="tune the buckets' mixed-rank variants (batches whose mean rank is known to be low)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--merge", action=argparse.BooleanOptionalAction, default=True,
                        help="keep the table's entries of other buckets (default: on)")
    parser.add_argument("--skip-tuned", action="store_true", help="leave buckets the table has alone")
    parser.add_argument("--table", type=Path, help="table to write (default: kernels/tables/<gpu>.json)")
    parser.add_argument("--time-budget", type=float, default=math.inf, metavar="SECONDS",
                        help="stop when spent, keeping the buckets done (default: none)")
    parser.add_argument("--jobs", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)),
                        help="processes compiling candidates ahead of the timing (default: CPUs - 1, <= 16)")
    parser.add_argument("--dry-run", action="store_true", help="list buckets and candidate counts; no GPU")
    args = parser.parse_args(argv)
    if not set(args.ranks) <= set(tiling.RANK_POINTS):
        parser.error(f"--ranks must be of tiling.RANK_POINTS {tiling.RANK_POINTS}: lookup rounds to those")
    for name in ("tokens", "groups"):
        if not set(getattr(args, name)) <= set(tiling.TOKEN_POINTS):
            parser.error(f"--{name} must be of tiling.TOKEN_POINTS {tiling.TOKEN_POINTS}: lookup rounds to those")
    if args.skip_tuned and not args.merge:
        parser.error("--skip-tuned keeps the table's entries: it needs --merge")
    try:
        args.models = [model_shape(spec) for spec in args.model]
    except ValueError as exc:
        parser.error(str(exc))
    args.ops, args.ranks, args.tokens = list(dict.fromkeys(args.ops)), sorted(set(args.ranks)), sorted(set(args.tokens))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    todo = buckets(args.models, args.ops, args.ranks, args.tokens, args.projections, args.mixed, args.groups)
    if args.dry_run:  # sizing a continued run needs the table named: without a GPU its name is unknown
        print_plan(untuned(todo, read_table(args.table)) if args.skip_tuned and args.table else todo)
        return 0
    if not torch.cuda.is_available():
        print("kernels.tuner times kernels on a CUDA GPU; none here (--dry-run needs none)", file=sys.stderr)
        return 2
    return tune(args, todo, shlex.join(["python", "-m", "kernels.tuner", *argv]))


if __name__ == "__main__":
    sys.exit(main())
