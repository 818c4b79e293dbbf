"""All-layer merge and restore of one rank-64 q,k,v,o adapter into a 7B-shaped model's weights
(32 layers), one GPU: time against the memory floor (bytes that must move once over the
device-to-device copy bandwidth measured in the same run).

    PYTHONPATH=.:protos python3 benchmarks/merge_bench.py           # the default launch shapes
    PYTHONPATH=.:protos python3 benchmarks/merge_bench.py --sweep   # every candidate, checked, then timed

--sweep checks each candidate launch shape against the torch reference (backup bit-exact, merged
weights at most one bfloat16 unit in the last place from the float32 reference rounded once,
restore bit-exact) and prints its time, floor and ratio, the default first: one GPU run picks
kernels/triton/merge.py's defaults.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.harness.cli import suite_parser
from kernels.adapter_arena import AdapterArena
from kernels.lora_stack import LoRAStack, packed_elems
from kernels import merge_weights, restore_weights
from kernels.merge import MergeTarget, merge_weights_reference
from kernels.triton.merge import (MERGE_CONFIGS, RESTORE_CONFIG, MergeConfig, RestoreConfig, merge_weights_triton,
                                  restore_weights_triton)
from kernels.tuner.timing import copy_bandwidth

# No spills on sm_90a (ptxas -v), 1 to 9 programs an SM; (block_n, block_k, num_warps).
MERGE_CANDIDATES = [MergeConfig(n, k, w) for n, k, w in (
    (16, 128, 4), (16, 256, 4), (32, 64, 2), (32, 64, 4), (32, 128, 2), (32, 128, 4), (32, 128, 8), (32, 256, 4),
    (32, 256, 8), (64, 64, 4), (64, 128, 4), (64, 128, 8), (64, 256, 8), (128, 64, 4), (128, 64, 8), (128, 128, 8))]
RESTORE_CANDIDATES = [RestoreConfig(b, w) for b, w in (
    (4096, 4), (8192, 4), (8192, 8), (16384, 8), (32768, 8), (32768, 16), (65536, 16))]
DTYPE = torch.bfloat16


def build_targets() -> list[MergeTarget]:
    """A 7B's q,k,v and o of 32 layers, one rank-64 adapter on every slice, all in one arena (as a worker's)."""
    projections = [sizes for _layer in range(32) for sizes in ((4096, 4096, 4096), (4096,))]
    arena = AdapterArena(sum(packed_elems(4096, sizes, [64] * len(sizes)) for sizes in projections), DTYPE, "cuda")
    targets = []
    for sizes in projections:
        stack = LoRAStack.empty(1, 4096, sizes, 64, arena)
        stack.set_slot(0, {s: (torch.randn(64, 4096, device="cuda", dtype=DTYPE) * .01,
                               torch.randn(n, 64, device="cuda", dtype=DTYPE) * .01)
                           for s, n in enumerate(sizes)}, 2.0)
        w = torch.randn(sum(sizes), 4096, device="cuda", dtype=DTYPE)
        targets.append(MergeTarget(w, torch.empty_like(w), stack))
    return targets


def time_ms(fn: Callable[[], None], n: int = 5) -> float:
    """Median of n runs after one warm-up (host work included: the GPU waits for it too)."""
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(n):
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[n // 2]


def host_ms(fn: Callable[[], None], n: int = 5) -> float:
    """What a call costs the host before its launch returns (the part the GPU may wait for)."""
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
    return sorted(ts)[n // 2]


def check_merge(targets: list[MergeTarget], originals: list[torch.Tensor], references: list[torch.Tensor]) -> str:
    """'ok' or what is wrong: backups bit-exact; weights within one bf16 ulp of the reference (plus
    float32 noise where W + delta cancels to ~0)."""
    eps, off_by_ulp = torch.finfo(DTYPE).eps, 0
    for target, original, reference in zip(targets, originals, references):
        if not torch.equal(target.backup, original):
            return "BACKUP DIFFERS"
        actual, expected = target.weight.float(), reference.float()
        diff = (actual - expected).abs()
        if not bool((diff <= torch.maximum(actual.abs(), expected.abs()) * eps + 1e-6).all()):
            return f"WRONG (max |diff| {diff.max().item():.3g})"
        off_by_ulp += int((diff > 0).sum())
    return f"ok ({off_by_ulp} elements one ulp off)"


def sweep(targets: list[MergeTarget], bandwidth: float, weight_bytes: int) -> None:
    merge_floor, restore_floor = 3 * weight_bytes / bandwidth * 1e3, 2 * weight_bytes / bandwidth * 1e3
    originals = [t.weight.clone() for t in targets]
    reference_targets = [MergeTarget(t.weight.clone(), torch.empty_like(t.weight), t.stack) for t in targets]
    merge_weights_reference(reference_targets, 0)
    references = [t.weight for t in reference_targets]
    del reference_targets
    default = MERGE_CONFIGS[torch.finfo(DTYPE).bits // 8]
    print(f"merge floor {merge_floor:.2f} ms (read W, write W and backup); candidates, the default first:")
    results = []
    for config in [default] + [c for c in MERGE_CANDIDATES if c != default]:
        for target, original in zip(targets, originals):
            target.weight.copy_(original)
        tag = f"block_n={config.block_n:3d} block_k={config.block_k:3d} warps={config.num_warps:2d}"
        tag += " (default)" if config == default else ""
        try:
            merge_weights_triton(targets, 0, config)
            torch.cuda.synchronize()
        except Exception as error:  # a shape the compiler or the GPU refuses: report it, go on
            print(f"  {tag}: FAILED {type(error).__name__}: {str(error).splitlines()[0][:100]}", flush=True)
            continue
        check = check_merge(targets, originals, references)
        ms = time_ms(lambda: merge_weights_triton(targets, 0, config))
        host = host_ms(lambda: merge_weights_triton(targets, 0, config))
        if check.startswith("ok"):
            results.append((ms, tag))
        print(f"  {tag}: {ms:.2f} ms, floor {merge_floor:.2f} ms, ratio {ms / merge_floor:.2f}, "
              f"host {host:.2f} ms, {check}", flush=True)
    del references

    print(f"restore floor {restore_floor:.2f} ms (read backup, write W):")
    restores = []
    for config in [RESTORE_CONFIG] + [c for c in RESTORE_CANDIDATES if c != RESTORE_CONFIG]:
        for target, original in zip(targets, originals):
            target.backup.copy_(original)
            target.weight.zero_()
        tag = f"block={config.block:5d} warps={config.num_warps:2d}"
        tag += " (default)" if config == RESTORE_CONFIG else ""
        restore_weights_triton(targets, config)
        exact = all(torch.equal(t.weight, o) for t, o in zip(targets, originals))
        ms = time_ms(lambda: restore_weights_triton(targets, config))
        if exact:
            restores.append((ms, tag))
        print(f"  {tag}: {ms:.2f} ms, floor {restore_floor:.2f} ms, ratio {ms / restore_floor:.2f}, "
              f"{'bit-exact' if exact else 'NOT BIT-EXACT'}", flush=True)
    if results:
        ms, tag = min(results)
        print(f"best merge: {tag}: {ms:.2f} ms, ratio {ms / merge_floor:.2f}")
    if restores:
        ms, tag = min(restores)
        print(f"best restore: {tag}: {ms:.2f} ms, ratio {ms / restore_floor:.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = suite_parser(__doc__)
    parser.add_argument("--sweep", action="store_true",
                        help="check and time every candidate launch shape of the merge and restore kernels")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("merge_bench needs a CUDA device")
    targets = build_targets()
    bandwidth = copy_bandwidth()
    weight_bytes = sum(x.weight.numel() * x.weight.element_size() for x in targets)
    print(f"device {torch.cuda.get_device_name()}, copy {bandwidth/1e12:.2f} TB/s; "
          f"q,k,v,o weights of a 7B: {weight_bytes/1e9:.2f} GB")
    if args.sweep:
        sweep(targets, bandwidth, weight_bytes)
        return
    m, r = time_ms(lambda: merge_weights(targets, 0)), time_ms(lambda: restore_weights(targets))
    merge_floor, restore_floor = 3 * weight_bytes / bandwidth * 1e3, 2 * weight_bytes / bandwidth * 1e3
    print(f"merge (read W, write W and backup): {m:.2f} ms, floor {merge_floor:.2f} ms, ratio {m / merge_floor:.2f}")
    print(f"restore (read backup, write W): {r:.2f} ms, floor {restore_floor:.2f} ms, ratio {r / restore_floor:.2f}")


if __name__ == "__main__":
    main()
