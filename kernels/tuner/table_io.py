"""The table on disk: this run's entries merged over the old table's, its static configurations,
and what the table already holds (buckets tuned, the K split an expand is tuned on)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from kernels import tiling
from kernels.tiling import Bucket, Config, ShrinkConfig


def static_configs(configs: dict[str, dict]) -> dict[str, dict]:
    """Per op, the configuration that wins the most buckets (ties: the lower total time over them):
    the fixed-tiling baseline of the benchmarks. One config must run every shape, so it is taken
    among tensor-core tiles (a 1-row tile re-reads the weights for every token of a prefill), and
    shrink's is unsplit (the planes of a split widen every expand's y tile; rank 128: past shared
    memory). Mixed-rank entries do not vote: their shapes are counted once, unmixed."""
    won: dict[tuple[str, Config], list[float]] = {}
    for key, entry in configs.items():
        if key.endswith("|mixed"):
            continue
        op = key.split("|", 1)[0]
        config = tiling.config_from(op, entry)
        if config.block_m == 1 or (isinstance(config, ShrinkConfig) and config.split_k > 1):
            continue
        won.setdefault((op, config), []).append(entry["us"])
    best: dict[str, tuple[tuple[int, float], Config]] = {}
    for (op, config), times in won.items():
        score = (len(times), -sum(times))
        if op not in best or score > best[op][0]:
            best[op] = (score, config)
    return {op: tiling.config_dict(config) for op, (_, config) in sorted(best.items())}


def merged_table(old: dict | None, new: dict[str, dict], header: dict) -> dict:
    """This run's entries over the old table's (None: start afresh); static configs recomputed."""
    old = old or {}
    configs = dict(sorted({**old.get("configs", {}), **new}.items()))
    runs = [*old.get("runs", []), {"date": header["date"], "command": header["command"]}]
    return {**header, "runs": runs, "static": static_configs(configs), "configs": configs}


def untuned(todo: Iterable[Bucket], table: dict | None) -> list[Bucket]:
    return [b for b in todo if b.key not in (table or {}).get("configs", {})]


def expands_on_heuristic_splits(todo: Sequence[Bucket], table: dict | None) -> list[Bucket]:
    """Expand buckets whose shrink neither the table nor this run tunes: they are timed on the
    heuristic shrink's y planes. Right for this table as a whole; wrong for entries copied into
    another table, whose shrinks may split differently (such an expand can run markedly slower)."""
    tuned = {b.key for b in todo if b.op == "shrink"} | set((table or {}).get("configs", {}))
    return [b for b in todo if b.op == "expand" and replace(b, op="shrink").key not in tuned]


def shrink_splits(bucket: Bucket, old: dict | None, new: dict[str, dict]) -> int:
    """The K split the shrink of `bucket`'s shape runs with (the table as tuned so far, else the
    heuristic): expand is tuned on as many y planes as that shrink writes. 1 for shrink buckets."""
    if bucket.op == "shrink":
        return 1
    configs = {**(old or {}).get("configs", {}), **new}
    return tiling.lookup(replace(bucket, op="shrink"), {"configs": configs}).split_k


def read_table(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def write_table(path: Path, table: dict) -> None:
    """Atomically: a reader (or a crash) sees the old table or the new one, never half of one."""
    text = json.dumps(table, indent=1) + "\n"  # serialize before touching the disk
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
