"""The ATMM LoRA kernels against fixed tiling and the usual torch baselines, one GPU, one run.

Each case is one square projection (in = out = hidden, one slice) serving a batch of requests on
n distinct adapters: a hidden size, a rank set, n, a token count and a layout (decode: one token a
request; prefill: a few long requests, one adapter's requests kept apart). Each op (shrink
x -> y, expand y -> out) is run by four implementations of one contract (`LoRAOp`):

    atmm_tuned   kernels.triton.lora_shrink / lora_expand, the tuned table's config for the case's bucket
    atmm_static  kernels.triton.lora_shrink / lora_expand, one fixed config for every case (Punica-like tiling)
    torch_loop   a Python loop over the batch's adapters, one matmul each (PEFT-like)
    gather_bmm   tokens and weights gathered into padded groups, one bmm (dLoRA-like)

each checked first against kernels.reference in float32 on fresh inputs (a mismatch aborts the
run), then timed in one CUDA graph over rotating input copies that span 3x L2 (weights rotate
too: copy c's adapters live in their own slots of one big stack), and set against its roofline:
the bytes the op must move at least once (`min_bytes`) over the copy bandwidth measured in the
same run. The summary checks the ATMM targets, shrink and expand separately, and shows the tuned
table's gain on the pair (`pair_speedups`).

    python -m benchmarks.kernel_bench [--quick] [--json OUT.json]   (from the repo root)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import torch
import triton

from kernels import reference, tiling
from kernels.tuner import timing

from benchmarks.harness.cli import command_line, suite_parser
from benchmarks.harness.lora_cases import (LAYOUTS, RANK_SETS, SEED, Case, case_inputs, copy_batch, make_cases, min_bytes,
                                           random_rows, random_stack)
from benchmarks.harness.lora_impls import IMPLS, OPS, Impl
from benchmarks.harness.report import write_json

FULL = {"hidden": [4096, 3584], "ranks": list(RANK_SETS), "adapters": [1, 4, 16, 64],
        "tokens": list(tiling.TOKEN_POINTS), "layouts": list(LAYOUTS)}  # the tuned token points
QUICK = {"hidden": [4096], "ranks": ["u16", "mixed"], "adapters": [4], "tokens": [8, 2048],
         "layouts": list(LAYOUTS)}
DEVICE, DTYPE = "cuda", torch.bfloat16  # what is measured (tests run the flow on CPU in float32)
RTOL, ATOL_OF_RMS = 2e-2, 5e-2  # bf16 check; see _expect_close

# Targets, each for shrink and expand separately.
LARGE_TOKENS = (2048, 8192)
FRACTION_GOAL = {"shrink": 0.6, "expand": 0.75}  # median roofline fraction of LARGE_TOKENS cases
SMALL_TOKENS, SMALL_US = 32, 4.0                 # median µs of cases with <= SMALL_TOKENS tokens
STATIC_SPEEDUP = 1.3                             # median static / tuned time where configs differ


TUNED_LOOKUP = {"shrink": tiling.shrink_config, "expand": tiling.expand_config}


# ---- check and measure ---------------------------------------------------------------------

class Mismatch(Exception):
    """An implementation's result is off the float32 reference."""


def check_case(case: Case, impls: dict[str, Impl], device: torch.device | str, dtype: torch.dtype) -> None:
    """Every implementation's y and out against kernels.reference on float32 copies of fresh
    inputs (one copy's slots); raises Mismatch naming the first that is off."""
    generator = torch.Generator(device).manual_seed(SEED)
    stack = random_stack(case, 1, dtype, device, generator)
    batch = copy_batch(case, 0, device)
    x = random_rows(1, case, dtype, device, generator)[0]
    # A base output well under the O(1) delta: bf16's rounding of out + delta (2^-9 of it) stays
    # within the delta's tolerance, and an expand that overwrote out would still show.
    out = random_rows(1, case, dtype, device, generator)[0] * 0.1
    stack32 = stack.copy(torch.float32, device)
    want_y = reference.lora_shrink(x.float(), stack32, batch)[0]  # [tokens, 1, max_rank]
    want_delta = torch.zeros(case.tokens, case.hidden, device=device)
    reference.lora_expand(want_delta, want_y[None], stack32, batch)
    ranks = torch.tensor(case.token_ranks(), device=device)
    keep = torch.arange(case.max_rank, device=device) < ranks[:, None]  # [tokens, max_rank]
    for name, impl in impls.items():
        op = impl(stack, batch)
        y = op.shrink(x)
        _expect_close(f"{name} shrink on {case.name}", op.dense(y)[keep], want_y[:, 0][keep])
        got = out.clone()
        op.expand(got, y)
        # The delta, not the sum: a wrong delta must not hide under the base output's magnitude.
        _expect_close(f"{name} expand on {case.name}", got.float() - out.float(), want_delta)


def _expect_close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 tolerance: rtol for each element, plus an atol of ATOL_OF_RMS x the reference's RMS
    for sums that cancel. The bf16 baselines round y twice and the delta twice; a rank-8 delta
    near zero, a sum of 8 terms of O(1), then errs by up to ~2% of the RMS (measured: worst
    error / tolerance 0.56 over an 8192 x 4096 expand). A wrong slot, scaling or row is off
    by O(RMS)."""
    atol = ATOL_OF_RMS * want.square().mean().sqrt().item()
    try:
        torch.testing.assert_close(got.float(), want, rtol=RTOL, atol=atol)
    except AssertionError as error:
        raise Mismatch(f"{what}: off the float32 reference (rtol {RTOL}, atol {atol:.3g})\n{error}") from None


@dataclass
class Row:
    """One (case, op): every implementation's time per call."""
    case: Case
    op: str
    bytes: int                  # min_bytes(op, case)
    copies: int                 # rotating input copies timed
    seconds: dict[str, float]   # implementation -> median seconds per call
    tuned_config: dict          # what atmm_tuned looked up for this bucket
    static_config: dict         # what atmm_static runs

    @property
    def configs_differ(self) -> bool:
        return self.tuned_config != self.static_config

    def fraction(self, impl: str, bandwidth: float) -> float:
        """Roofline time over measured time."""
        return self.bytes / bandwidth / self.seconds[impl]

    def to_json(self, bandwidth: float) -> dict:
        c = self.case
        return {"case": c.name, "hidden": c.hidden, "ranks": c.ranks, "adapters": c.adapters, "tokens": c.tokens,
                "layout": c.layout, "requests": len(c.seg_lens), "used_adapters": len(c.used_adapters()),
                "op": self.op, "bytes": self.bytes, "copies": self.copies,
                "us": {impl: s * 1e6 for impl, s in self.seconds.items()},
                "fraction": {impl: self.fraction(impl, bandwidth) for impl in self.seconds},
                "configs_differ": self.configs_differ, "tuned_config": self.tuned_config,
                "static_config": self.static_config}


def measure_case(case: Case, impls: dict[str, Impl], device: torch.device | str, dtype: torch.dtype, copies: int,
                 timer: Callable[[list[Callable[[], object]]], float] = timing.graph_time_s) -> list[Row]:
    """Time shrink, then expand, of every implementation over `copies` rotating inputs. Expand's
    y comes from an untimed shrink of the same copy; its out accumulates over replays (the
    deltas are O(1): it stays finite)."""
    stack, batches, xs, outs = case_inputs(case, copies, device, dtype)
    seconds: dict[str, dict[str, float]] = {op: {} for op in OPS}
    for name, impl in impls.items():
        ops = [impl(stack, batch) for batch in batches]
        seconds["shrink"][name] = timer([functools.partial(op.shrink, x) for op, x in zip(ops, xs)])
        ys = [op.shrink(x) for op, x in zip(ops, xs)]
        seconds["expand"][name] = timer([functools.partial(op.expand, out, y) for op, out, y in zip(ops, outs, ys)])
    return [Row(case, op, min_bytes(op, case), copies, seconds[op],
                tiling.config_dict(TUNED_LOOKUP[op](stack, batches[0])),
                tiling.config_dict(tiling.static_config(op, stack.device))) for op in OPS]


# ---- summary and report --------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    op: str
    what: str
    value: float | None   # None: no case of this run measures it
    bound: float
    at_least: bool        # value must be >= bound (else <= bound)
    detail: str = ""

    @property
    def status(self) -> str:
        if self.value is None:
            return "n/a"
        return "PASS" if (self.value >= self.bound if self.at_least else self.value <= self.bound) else "MISS"

    def to_json(self) -> dict:
        return {**asdict(self), "status": self.status}


def summarize(rows: list[Row], bandwidth: float) -> list[Target]:
    targets = []
    for op in OPS:
        mine = [r for r in rows if r.op == op]
        large = [r.fraction("atmm_tuned", bandwidth) for r in mine if r.case.tokens in LARGE_TOKENS]
        small = [r.seconds["atmm_tuned"] * 1e6 for r in mine if r.case.tokens <= SMALL_TOKENS]
        speedups = [r.seconds["atmm_static"] / r.seconds["atmm_tuned"] for r in mine if r.configs_differ]
        slower = [(r.case.name, r.seconds["atmm_tuned"] / min(r.seconds["torch_loop"], r.seconds["gather_bmm"]))
                  for r in mine]
        slower = [(name, ratio) for name, ratio in slower if ratio > 1]
        targets += [
            Target(op, f"median atmm_tuned roofline fraction, {'/'.join(map(str, LARGE_TOKENS))} tokens",
                   _median(large), FRACTION_GOAL[op], at_least=True),
            Target(op, f"median atmm_tuned µs, <= {SMALL_TOKENS} tokens", _median(small), SMALL_US, at_least=False),
            Target(op, f"median atmm_static / atmm_tuned time where configs differ ({len(speedups)} cases)",
                   _median(speedups), STATIC_SPEEDUP, at_least=True),
            Target(op, "cases where atmm_tuned is slower than min(torch_loop, gather_bmm)",
                   len(slower) if mine else None, 0, at_least=False,
                   detail="; ".join(f"{name} x{ratio:.2f}" for name, ratio in slower)),
        ]
    return targets


def pair_speedups(rows: list[Row]) -> list[float]:
    """Static over tuned time of shrink + expand, for each case where either op's configs differ.
    Not one of the targets, which take each op alone: a tuned shrink that splits K hands its
    expand float32 planes to sum, which the static pair (one unsplit plane) never pays, so the
    expand's own ratio undercounts what the table buys the pair."""
    ops = {(r.case, r.op): r for r in rows}
    pairs = [(ops[case, "shrink"], ops[case, "expand"]) for case, op in ops if op == "shrink" and (case, "expand") in ops]
    return [(s.seconds["atmm_static"] + e.seconds["atmm_static"]) / (s.seconds["atmm_tuned"] + e.seconds["atmm_tuned"])
            for s, e in pairs if s.configs_differ or e.configs_differ]


def format_pairs(speedups: list[float]) -> str:
    value = "-" if not speedups else f"{statistics.median(speedups):.3g}"
    return f"info pair   median atmm_static / atmm_tuned time of shrink + expand where configs differ ({len(speedups)} cases): {value}"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def format_header() -> str:
    return f"{'case':<32} {'op':<6} " + " ".join(f"{name + ' µs frac':>22}" for name in IMPLS)


def format_row(row: Row, bandwidth: float) -> str:
    cells = " ".join(f"{row.seconds[impl] * 1e6:15.1f} {row.fraction(impl, bandwidth):6.2f}" for impl in row.seconds)
    return f"{row.case.name:<32} {row.op:<6} {cells}{'  (tuned != static)' if row.configs_differ else ''}"


def format_target(t: Target) -> str:
    value = "-" if t.value is None else f"{t.value:.3g}"
    goal = f"{'>=' if t.at_least else '<='} {t.bound:g}"
    return f"{t.status:<4} {t.op:<6} {t.what}: {value} (goal {goal}){'  ' + t.detail if t.detail else ''}"


def payload(header: dict, rows: list[Row], targets: list[Target] | None, bandwidth: float) -> dict:
    """The JSON report, rewritten after every case: a run cut short keeps what it measured (complete: false)."""
    pairs = pair_speedups(rows)
    return {**header, "complete": targets is not None, "rows": [r.to_json(bandwidth) for r in rows],
            "summary": [t.to_json() for t in targets or []],
            "pair_static_over_tuned": {"median": _median(pairs), "cases": len(pairs)}}


# ---- main ----------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = suite_parser(__doc__)
    parser.add_argument("--hidden", type=int, nargs="+", help=f"hidden sizes (default {FULL['hidden']})")
    parser.add_argument("--ranks", nargs="+", choices=list(RANK_SETS), help="rank sets (default all)")
    parser.add_argument("--adapters", type=int, nargs="+", help=f"distinct adapters (default {FULL['adapters']})")
    parser.add_argument("--tokens", type=int, nargs="+", help=f"batch tokens (default {FULL['tokens']})")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), help="layouts (default both)")
    parser.add_argument("--quick", action="store_true", help=f"defaults to a small grid: {QUICK}")
    parser.add_argument("--json", type=Path, help="write rows, summary, device, date and command line here")
    args = parser.parse_args(argv)
    for key, default in (QUICK if args.quick else FULL).items():  # explicit flags win over --quick
        if getattr(args, key) is None:
            setattr(args, key, default)
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("kernel_bench needs a CUDA GPU")
    cases = make_cases(args.hidden, args.ranks, args.adapters, args.tokens, args.layouts)
    bandwidth = timing.copy_bandwidth()
    header = {"device": torch.cuda.get_device_name(), "date": datetime.now().isoformat(timespec="seconds"),
              "command": command_line("benchmarks.kernel_bench", argv), "torch": torch.__version__,
              "triton": triton.__version__, "copy_bandwidth_Bps": bandwidth,
              "tables": tiling.table_for(torch.device(DEVICE))["sources"]}
    print(f"{header['device']}  {header['date']}  torch {torch.__version__}  triton {triton.__version__}  "
          f"tables: {', '.join(header['tables']) or 'none (heuristics)'}")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + written); {len(cases)} cases x {len(OPS)} ops")
    print(format_header(), flush=True)
    rows: list[Row] = []
    for case in cases:
        try:
            check_case(case, IMPLS, DEVICE, DTYPE)
        except Mismatch as error:
            sys.exit(f"ABORT: {error}")
        copies = timing.copies_needed(min(min_bytes(op, case) for op in OPS))
        for row in measure_case(case, IMPLS, DEVICE, DTYPE, copies):
            print(format_row(row, bandwidth), flush=True)
            rows.append(row)
        torch.cuda.empty_cache()  # the case's stack and inputs are gone: give their blocks back
        write_json(args.json, payload(header, rows, None, bandwidth))
    targets = summarize(rows, bandwidth)
    print("\nsummary")
    for target in targets:
        print(format_target(target))
    print(format_pairs(pair_speedups(rows)))
    report = payload(header, rows, targets, bandwidth)
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
