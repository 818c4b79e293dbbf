"""How a suite is run: its parser (the module docstring as its help), the options the engine suites
share, the command line it records, and a clean exit on SIGTERM for the suites that start processes.

    parser = suite_parser(__doc__)
    add_tiny_run_options(parser)              # --tiny --device --trace --json
    args = parse_tiny_run_args(parser, argv)  # CUDA asked for where there is none: refused
    report = run(args) | {"command": command_line("benchmarks.modes_bench", argv)}
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.harness.traces import TRACE


def suite_parser(doc: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_tiny_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of a suite that runs a 7B-shaped model on a GPU, or a tiny one (a smoke run)."""
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (with --device cpu: a smoke run)")
    parser.add_argument("--device", default="cuda", help='"cuda", "cuda:1" or "cpu" (with --tiny)')
    parser.add_argument("--trace", type=Path, default=TRACE, help=f"the conv trace's CSV (default {TRACE})")
    parser.add_argument("--json", type=Path, help="write the report here")


def parse_gpu_or_tiny_args(doc: str | None, argv: list[str] | None, tiny: str,
                           more: Callable[[argparse.ArgumentParser], None] = lambda parser: None) -> argparse.Namespace:
    """The options of a suite that runs a 7B shape on a GPU, or with --tiny the `tiny` model on CPU (a smoke
    run): --tiny and --json, and what `more` adds. Without --tiny, CUDA must be there."""
    parser = suite_parser(doc)
    parser.add_argument("--tiny", action="store_true", help=f"{tiny} on CPU (a smoke run)")
    parser.add_argument("--json", type=Path, help="write the report here")
    more(parser)
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("CUDA is not available: use --tiny")
    return args


def parse_tiny_run_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("CUDA is not available: use --device cpu --tiny")
    return args


def add_cpu_lora_options(parser: argparse.ArgumentParser) -> None:
    """The CPU LoRA workers beside the engine (the cold-start suites)."""
    parser.add_argument("--workers", type=int, default=4, help="CPU LoRA workers")
    parser.add_argument("--cores-each", type=int, default=3)
    parser.add_argument("--shm-dir", default="/dev/shm", help="where the host tier and the work area are mapped")


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """The command that ran the suite: the process's own when run from a shell (argv None), else the
    one that repeats this call of its main(argv)."""
    return shlex.join(sys.orig_argv if argv is None else ["python", "-m", module, *argv])


@contextmanager
def exits_on_sigterm() -> Iterator[None]:
    """Inside, SIGTERM (a `timeout`) exits through SystemExit, so the finally blocks still run: the live
    system's roles are stopped and temporary homes removed. The previous handler is back on leaving."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
