"""Reading a Hugging Face checkpoint's safetensors, one tensor at a time."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def _weight_files(checkpoint_dir: Path) -> list[str]:
    """model.safetensors, or the shards listed in model.safetensors.index.json."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (checkpoint_dir / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise FileNotFoundError(f"no safetensors weights in {checkpoint_dir}")


def iter_checkpoint(checkpoint_dir: Path,
                    select: Callable[[str], str | None] = lambda name: name) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor that `select` keeps: it maps a checkpoint name to the name the
    caller wants, or to None to skip the tensor without reading it."""
    for file in _weight_files(checkpoint_dir):
        with safe_open(checkpoint_dir / file, framework="pt") as f:
            for name in f.keys():
                wanted = select(name)
                if wanted is not None:
                    yield wanted, f.get_tensor(name)


def part_selector(prefixes: tuple[tuple[str, str, str], ...], part: str,
                  source: str) -> Callable[[str], str | None]:
    """For a checkpoint of several parts (a language model, a vision tower): checkpoint name -> its name
    inside `part`, or None for another part's tensor. prefixes: (checkpoint name prefix, the part it
    belongs to, its prefix there), the first match wins; a name no prefix matches is an error."""
    def select(name: str) -> str | None:
        for prefix, owner, ours in prefixes:
            if name.startswith(prefix):
                return ours + name[len(prefix):] if owner == part else None
        raise ValueError(f"{source}: tensor {name!r} belongs to no part of the model")
    return select
