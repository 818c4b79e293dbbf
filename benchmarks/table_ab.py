"""Two LoRA tile tables, A/B on one GPU: for every shape whose shrink or expand entry differs, the shrink and
the expand of each table timed on kernels.tune's harness (its representative batches, one CUDA graph over
rotating copies). Each table's expand runs on the y planes its own shrink writes, so the pair (shrink +
expand) is what a retune changes for the model. Each configuration is timed twice and the faster run kept,
to damp the machine's drift between the two tables' timings.

    PYTHONPATH=.:protos python -m benchmarks.table_ab OLD.json NEW.json --match "|g1"

Prints, per shape, old and new microseconds of each op and old/new of the pair; then the median and geometric
mean of those ratios. A ratio above 1: the new table is faster.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import torch

from kernels import tune, tuning
from kernels.tuning import Bucket

DTYPE = torch.bfloat16
RUNS = 2  # timings per configuration; the least is kept


def changed_shapes(old: dict, new: dict, match: str = "") -> list[str]:
    """Keys without their op ("k4096|n4096|r64|t32|g1") of the shapes whose shrink or expand entry differs,
    whose key contains `match`."""
    keys = set(old["configs"]) | set(new["configs"])
    return sorted({key.split("|", 1)[1] for key in keys
                   if old["configs"].get(key) != new["configs"].get(key) and match in key})


def op_seconds(bucket: Bucket, table: dict) -> float:
    """Mean seconds per call of `table`'s configuration for `bucket` over the bucket's batch shapes, after a
    check against the float32 reference."""
    config = tuning.lookup(bucket, table)
    splits = tune.shrink_splits(bucket, table, {})  # the y planes this table's shrink writes
    elem_size = torch.empty((), dtype=DTYPE).element_size()
    work = tune.Workload.build(bucket, tune.rotation_copies(bucket, elem_size, splits), DTYPE, "cuda", splits=splits)
    try:
        work.check(config)
        return min(statistics.fmean(work.seconds(config)) for _ in range(RUNS))
    finally:
        del work
        torch.cuda.empty_cache()


def compare(shape: str, old: dict, new: dict) -> tuple[str, float]:
    """(report line, old/new time of shrink + expand) for one shape."""
    times = {(op, name): op_seconds(Bucket.from_key(f"{op}|{shape}"), table)
             for op in tune.OPS for name, table in (("old", old), ("new", new))}
    pair = sum(times[(op, "old")] for op in tune.OPS) / sum(times[(op, "new")] for op in tune.OPS)
    cells = "  ".join(f"{op} {times[(op, 'old')] * 1e6:8.2f} -> {times[(op, 'new')] * 1e6:8.2f} us" for op in tune.OPS)
    return f"{shape:<42} {cells}  pair old/new {pair:5.2f}", pair


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="table A (kernels/tables/<gpu>.json layout)")
    parser.add_argument("new", type=Path, help="table B")
    parser.add_argument("--match", default="", help="only shapes whose keys contain this text, e.g. '|g1'")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    old, new = (json.loads(path.read_text()) for path in (args.old, args.new))
    shapes = changed_shapes(old, new, args.match)
    if not torch.cuda.is_available():
        sys.exit("table_ab needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}  {datetime.now().isoformat(timespec='seconds')}  "
          f"{len(shapes)} shapes differ", flush=True)
    pairs = []
    for shape in shapes:
        line, pair = compare(shape, old, new)
        pairs.append(pair)
        print(line, flush=True)
    if pairs:
        print(f"pair old/new over {len(pairs)} shapes: median {statistics.median(pairs):.3f}, "
              f"geometric mean {statistics.geometric_mean(pairs):.3f}")


if __name__ == "__main__":
    main()
