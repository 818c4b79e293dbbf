"""Tile configurations of the LoRA kernels: the offline-tuned table and its O(1) lookup.

`python -m kernels.tuner` times candidate configurations for each shape bucket of a model on the
local GPU and writes `kernels/tables/<gpu>.json`. At run time a call's bucket key is built from
host ints only (the projection's shape, the rank bound, the batch's token count and its largest
group, each rounded up to a tuned point) and looked up in a dict. A GPU's buckets missing from its
own table come from tables tuned on GPUs of its architecture (an H100 runs an H200's entries: the
same SMs, shared memory and instructions); what no such table has gets the heuristics below,
measured on Hopper before the tuner existed.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from kernels.batch import LoRABatch
from kernels.lora_stack import LoRAStack

TABLE_DIR = Path(__file__).parent / "tables"
TOKEN_POINTS = (1, 8, 32, 128, 512, 2048, 8192)  # tuned batch sizes and group sizes
RANK_POINTS = (16, 64, 128)  # tuned rank tiles (the rank bound rounded up; 32 uses the 64 entry)
# Expand sums the planes of shrink's split-K y in each of its programs: a [split, rows, rank] fp32
# tile (rows: up to 64 of a group). Past ~8K elements that costs expand more than the split saves
# shrink (e.g. 32 planes of rank 64 for 8-token groups; docs/benchmarks/kernels.md).
PLANE_TILE_CAP = 8192
MIXED_MEAN_RANK = 0.5  # a batch is mixed-rank when its token-weighted mean rank is under this share of its largest
TARGET_PROGRAMS = 528  # heuristic split-K aims at about this many programs: 4 per SM of an H100/H200


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int     # tokens per tile; < 16: CUDA-core multiply-sum instead of tl.dot (decode)
    block_k: int     # in_features per inner step
    split_k: int     # programs sharing one tile's K range, each storing a partial sum (a power of 2)
    num_warps: int
    num_stages: int
    rank_block: int = 0  # ranks per program (a power of 2); 0: the whole rank tile. Programs
    #                      past an adapter's own rank exit at once: low ranks cost no padding.


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int     # tokens per tile; < 16: CUDA-core multiply-sum instead of tl.dot (decode)
    block_n: int     # out_features per step; a program's columns never straddle two slices
    n_steps: int     # block_n steps per program: amortizes its prologue, pipelines B loads
    num_warps: int
    num_stages: int
    pipeline: bool = False  # (tiles of 16+ rows) each step loads its out tile in the loop, as the
    #                         product's accumulator, for the compiler to prefetch num_stages - 1 steps
    #                         ahead through shared memory, instead of one step ahead in registers
    m_steps: int = 1  # > 1: B-stationary (tiles of 16+ rows, n_steps 1): a program holds one column tile
    #                   of B and walks up to m_steps M-tiles of its group, each pipelined as above

    @property
    def stationary(self) -> bool:
        return self.m_steps > 1


Config = ShrinkConfig | ExpandConfig
CONFIG_TYPES: dict[str, type[ShrinkConfig] | type[ExpandConfig]] = {"shrink": ShrinkConfig, "expand": ExpandConfig}


@dataclass(frozen=True)
class Bucket:
    """One tuned shape: what a configuration is chosen by."""
    op: str                      # "shrink" | "expand"
    in_features: int
    out_sizes: tuple[int, ...]   # the projection's output slices (fused qkv: 3)
    block_r: int                 # rank tile (the rank bound, rounded up to a RANK_POINT)
    tokens: int                  # batch tokens, rounded up to a TOKEN_POINT
    group: int                   # largest group's tokens, rounded up to a TOKEN_POINT (<= tokens)
    mixed: bool = False          # known to mix ranks (`is_mixed`): tuned on mixed-rank batches only

    @property
    def key(self) -> str:
        out = "+".join(map(str, self.out_sizes))
        mixed = "|mixed" if self.mixed else ""
        return f"{self.op}|k{self.in_features}|n{out}|r{self.block_r}|t{self.tokens}|g{self.group}{mixed}"

    @staticmethod
    def from_key(key: str) -> Bucket:
        """The bucket whose `key` is `key` (a table's entry name)."""
        try:
            op, k, n, r, t, g, *mixed = key.split("|")
            bucket = Bucket(op, int(k.removeprefix("k")), tuple(int(size) for size in n.removeprefix("n").split("+")),
                            int(r.removeprefix("r")), int(t.removeprefix("t")), int(g.removeprefix("g")), bool(mixed))
        except ValueError:
            bucket = None
        if bucket is None or op not in CONFIG_TYPES or bucket.key != key:
            raise ValueError(f"not a bucket key: {key!r}")
        return bucket


def round_up(value: int, points: tuple[int, ...]) -> int:
    """The smallest point >= value (the last one past the end)."""
    return _round_up_table(points)[min(max(value, 1), points[-1])]


@functools.cache
def _round_up_table(points: tuple[int, ...]) -> tuple[int, ...]:
    """Index v -> the smallest point >= v, precomputed so that a lookup is one index."""
    return tuple(next(p for p in points if p >= v) for v in range(points[-1] + 1))


def bucket_of(op: str, stack: LoRAStack, batch: LoRABatch) -> Bucket:
    sizes = tuple(hi - lo for lo, hi in zip(stack.out_offsets, stack.out_offsets[1:]))
    tokens = round_up(batch.num_tokens, TOKEN_POINTS)
    group = min(round_up(min(batch.max_group_len, batch.num_tokens), TOKEN_POINTS), tokens)
    # The rank tile the kernels use: the batch's bound when known, else the stack's max rank.
    bound = batch.rank_bound(stack.max_rank)
    return Bucket(op, stack.in_features, sizes, round_up(bound, RANK_POINTS), tokens, group,
                  is_mixed(batch.mean_rank, bound))


def is_mixed(mean_rank: float | None, rank_bound: int) -> bool:
    """Whether a batch's ranks are mixed enough to want other tiles than its largest rank alone.
    Rank-128 tiles suit a batch of rank-128 adapters, but when most tokens use ranks far below it
    (ranks 8-128 in turn: mean 50) wide tiles multiply padding, and rank-block tiles leave so few
    live programs that a smaller count of wider ones fits one wave better: the best configuration
    for such prefill shrinks beats the one that also serves uniform rank-128 batches by a wide
    margin (docs/benchmarks/kernels.md). Unknown (None): not mixed, the entry that serves both."""
    return mean_rank is not None and mean_rank < MIXED_MEAN_RANK * rank_bound


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': the table's file name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@functools.cache
def load_table(gpu_name: str, capability: str | None = None) -> dict:
    """The entries to run on this GPU model: its own table's over those of the tables tuned on
    other GPUs of its compute capability ("9.0"), each bucket from the first table that has it;
    `sources` names the tables used, own first. The static configuration is the own table's if it
    has one (its configurations were timed here), else a sibling's. No table: empty."""
    own_path = TABLE_DIR / f"{gpu_slug(gpu_name)}.json"
    layers = [json.loads(own_path.read_text())] if own_path.exists() else []
    if capability is not None:  # sorted: the same GPU always gets the same entries
        layers += [table for path in sorted(TABLE_DIR.glob("*.json")) if path != own_path
                   and (table := json.loads(path.read_text())).get("capability") == capability]
    configs: dict[str, dict] = {}
    static: dict[str, dict] = {}
    for layer in reversed(layers):  # the own table last: its entries win
        configs.update(layer["configs"])
        static.update(layer["static"])
    return {"gpu": gpu_name, "sources": [layer["gpu"] for layer in layers], "configs": configs, "static": static}


def table_for(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"sources": [], "configs": {}, "static": {}}
    return load_table(*_device_identity(device.index if device.index is not None else torch.cuda.current_device()))


@functools.cache
def _device_identity(index: int) -> tuple[str, str]:
    """(name, compute capability as "major.minor"): what picks a device's tables."""
    return torch.cuda.get_device_name(index), capability_of(index)


def capability_of(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"{major}.{minor}"


def config_from(op: str, entry: dict) -> Config:
    cls = CONFIG_TYPES[op]
    return cls(**{field: entry[field] for field in cls.__dataclass_fields__ if field in entry})  # else its default


def config_dict(config: Config) -> dict:
    return asdict(config)


def shrink_config(stack: LoRAStack, batch: LoRABatch) -> ShrinkConfig:
    return _lookup("shrink", stack, batch)  # type: ignore[return-value]


def expand_config(stack: LoRAStack, batch: LoRABatch) -> ExpandConfig:
    return _lookup("expand", stack, batch)  # type: ignore[return-value]


def _lookup(op: str, stack: LoRAStack, batch: LoRABatch) -> Config:
    return lookup(bucket_of(op, stack, batch), table_for(stack.device))


def lookup(bucket: Bucket, table: dict) -> Config:
    """The table's configuration for `bucket`, else (mixed-rank buckets) for the same bucket
    without the mix, else the heuristic's."""
    entry = table["configs"].get(bucket.key)
    if entry is None and bucket.mixed:
        entry = table["configs"].get(replace(bucket, mixed=False).key)
    if entry is not None:
        return config_from(bucket.op, entry)
    return heuristic_config(bucket)


def static_config(op: str, device: torch.device) -> Config:
    """The one configuration that did best over all tuned buckets (the fixed-tiling baseline);
    without a table, the heuristic's choice for a mid-size prefill."""
    entry = table_for(device)["static"].get(op)
    if entry is not None:
        return config_from(op, entry)
    return heuristic_config(Bucket(op, 4096, (4096,), 64, 512, 128))


def heuristic_config(bucket: Bucket) -> Config:
    return _heuristic_shrink(bucket) if bucket.op == "shrink" else _heuristic_expand(bucket)


def _block_m(group: int) -> int:
    return 16 if group <= 16 else 32 if group <= 32 else 64


def _heuristic_shrink(b: Bucket) -> ShrinkConfig:
    """Decode-like buckets (small groups) leave few programs: split K so that about
    TARGET_PROGRAMS run (~512 of K each at least). Longer tiles keep split_k = 1: splitting a
    prefill's K made it several times slower."""
    block_m = _block_m(b.group)  # tl.dot even for decode: multiply-sum measured slower
    block_k = min(64 if block_m <= 32 or b.block_r > 64 else 128, max(16, _next_pow2(b.in_features)))
    split_k = 1
    if block_m <= 32:
        programs = max(1, b.tokens // max(b.group, 1)) * len(b.out_sizes)
        split_k = min(_next_pow2(-(-TARGET_PROGRAMS // programs)), _prev_pow2(max(1, b.in_features // 512)),
                      max_split(b.block_r, b.group))
    return ShrinkConfig(block_m, block_k, split_k, num_warps=4, num_stages=3 if b.block_r <= 64 else 2)


def _heuristic_expand(b: Bucket) -> ExpandConfig:
    """One-token groups (decode) take 1-row tiles multiplied on CUDA cores: faster than a 16-row
    tl.dot that wastes 15 rows and moves B through shared memory."""
    block_n = min(128, max(16, _next_pow2(max(b.out_sizes))))
    if b.group == 1:  # multiply-sum tile [block_r, block_n]: <= 64 fp32 registers a thread
        return ExpandConfig(1, max(16, min(block_n, 8192 // b.block_r)), n_steps=4, num_warps=4, num_stages=3)
    if b.tokens <= 64:  # possibly one live tile: one N step a program
        return ExpandConfig(_block_m(b.group), block_n, n_steps=1, num_warps=4, num_stages=2)
    return ExpandConfig(_block_m(b.group), block_n, n_steps=2, num_warps=4, num_stages=2)


def max_split(block_r: int, group: int) -> int:
    """The most K splits (a power of 2) whose y planes keep expand's plane tile under PLANE_TILE_CAP."""
    return _prev_pow2(max(1, PLANE_TILE_CAP // (block_r * min(group, 64))))


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _prev_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)
