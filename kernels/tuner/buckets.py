"""The buckets a tuning run covers: the models' fused projections, by op, rank tile, batch size T
and largest group G."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kernels.tiling import TOKEN_POINTS, Bucket
from kernels.tuner.batches import MAX_GROUPS, spread_lens

OPS = ("shrink", "expand")
PROJECTIONS = ("o", "qkv", "gate_up", "down")


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    def projections(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """name -> (in_features, out slices), fused as the engine runs them."""
        h, i = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"qkv": (h, (q, kv, kv)), "o": (q, (h,)), "gate_up": (h, (i, i)), "down": (i, (h,))}


PRESETS = {
    "llama-7b": ModelShape(hidden=4096, intermediate=11008, heads=32, kv_heads=32, head_dim=128),
    "qwen2-7b": ModelShape(hidden=3584, intermediate=18944, heads=28, kv_heads=4, head_dim=128),
}


def model_shape(spec: str) -> ModelShape:
    """A preset's name, or a local HF model directory / config.json (read, never fetched)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"{spec!r} is neither a preset ({', '.join(PRESETS)}) nor a local config.json")
    config = json.loads(path.read_text())
    if "hidden_size" not in config:  # vision-language configs nest the language model's
        config = config.get("text_config", config)
    try:
        heads = config["num_attention_heads"]
        return ModelShape(hidden=config["hidden_size"], intermediate=config["intermediate_size"], heads=heads,
                          kv_heads=config.get("num_key_value_heads") or heads,
                          head_dim=config.get("head_dim") or config["hidden_size"] // heads)
    except KeyError as exc:
        raise ValueError(f"{path} has no {exc.args[0]}") from None


def token_groups(tokens: Iterable[int], groups: Iterable[int] = TOKEN_POINTS) -> list[tuple[int, int]]:
    """(T, G) pairs: G one of `groups` (token points) <= T, and at most MAX_GROUPS groups in the
    representative batch."""
    groups = set(groups)
    return [(t, g) for t in tokens for g in TOKEN_POINTS
            if g in groups and g <= t and len(spread_lens(t, g)) <= MAX_GROUPS]


def buckets(models: Sequence[ModelShape], ops: Sequence[str], ranks: Sequence[int],
            tokens: Sequence[int], names: Sequence[str] = PROJECTIONS, mixed: bool = False,
            groups: Sequence[int] = TOKEN_POINTS) -> list[Bucket]:
    """Every bucket of the models' projections named (shared shapes once): all shrink buckets, then
    all expand buckets (an expand is tuned on the y planes its shrink's tuned split writes).
    `mixed`: their mixed-rank variants instead (tiling.is_mixed); `groups`: largest-group sizes G kept."""
    projections = dict.fromkeys(shape for name in names for model in models
                                for shape in [model.projections()[name]])
    return [Bucket(op, k, sizes, r, t, g, mixed) for op in ops for k, sizes in projections for r in ranks
            for t, g in token_groups(tokens, groups)]
