"""Reads a PEFT LoRA adapter from the adapter store, safely.

Safety rules (DESIGN invariants): the directory must resolve inside the configured store root;
weights are read only from adapter_model.safetensors (a pickle `.bin` is never unpickled); the
file's sha256 must equal the registry's record, and the tensors are parsed from the very bytes
that were hashed, so the file cannot change between check and use.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from services.common.adapter_layout import AdapterLayout, refuse_vision_tensors
from services.common.errors import FailedPrecondition, InvalidArgument, PermissionDenied

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


@dataclass(frozen=True)
class AdapterRef:
    """What the registry says about an adapter (from the Adapter message)."""
    name: str
    base_model: str
    rank: int
    sha256: str
    storage_path: str


@dataclass(frozen=True)
class LoRAWeights:
    """One loaded adapter: (layer, target) -> A [rank, in], B [out, rank]; scaling = alpha / rank."""
    name: str
    rank: int
    scaling: float
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def resolve_in_store(storage_path: str, store_root: Path) -> Path:
    directory = Path(storage_path).expanduser().resolve()
    root = store_root.expanduser().resolve()
    if not directory.is_relative_to(root):
        raise PermissionDenied(f"adapter directory {directory} is outside the adapter store {root}")
    return directory


def _read_config(directory: Path) -> dict:
    config = json.loads((directory / CONFIG_FILE).read_text())
    if config.get("peft_type") != "LORA":
        raise InvalidArgument(f"{directory}: not a LoRA adapter (peft_type={config.get('peft_type')!r})")
    unsupported = [key for key in ("use_dora", "use_rslora", "fan_in_fan_out") if config.get(key)]
    unsupported += [key for key in ("rank_pattern", "alpha_pattern") if config.get(key)]
    if unsupported:
        raise InvalidArgument(f"{directory}: unsupported LoRA options {unsupported}")
    return config


def _served_targets(ref: AdapterRef, tensors: dict[str, torch.Tensor], layout: AdapterLayout,
                    layer_paths: dict[str, str]) -> list[str]:
    """The PEFT target names the adapter adapts, read from its tensor names: adapter_config.json may
    name them by a regex (r".*language_model.*\\.(q_proj|v_proj)") rather than a list."""
    in_layer = re.compile(rf"{re.escape(layout.layers_prefix)}\.\d+\.(.+)\.lora_[AB]\.weight")
    paths = {match.group(1) for name in tensors if (match := in_layer.fullmatch(name))}
    unknown = sorted(paths - set(layer_paths.values()))
    if unknown:
        raise InvalidArgument(f"adapter {ref.name}: target modules {unknown} are not served")
    if not paths:
        raise InvalidArgument(f"adapter {ref.name}: no LoRA tensors under {layout.layers_prefix}")
    return sorted(target for target, path in layer_paths.items() if path in paths)


def load_adapter(ref: AdapterRef, store_root: Path, layout: AdapterLayout, layer_paths: dict[str, str],
                 num_layers: int) -> LoRAWeights:
    """Load and verify `ref`. `layout`: where the base model's family keeps LoRA tensors;
    `layer_paths`: PEFT target name -> module path in a decoder layer, for the targets served."""
    directory = resolve_in_store(ref.storage_path, store_root)
    weights_file = directory / WEIGHTS_FILE
    if not weights_file.is_file():
        pickled = " (a pickle adapter_model.bin is there; it is never loaded)" if (directory / "adapter_model.bin").exists() else ""
        raise FailedPrecondition(f"adapter {ref.name}: {weights_file} not found{pickled}")
    config = _read_config(directory)
    data = weights_file.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != ref.sha256.lower():
        raise FailedPrecondition(f"adapter {ref.name}: sha256 {digest} does not match the registry's {ref.sha256}")
    tensors = load_safetensors(data)

    refuse_vision_tensors(layout, tensors, f"adapter {ref.name}")
    targets = _served_targets(ref, tensors, layout, layer_paths)
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in range(num_layers):
        for target in targets:
            names = [layout.tensor_name(layer, layer_paths[target], which) for which in "AB"]
            if not all(name in tensors for name in names):
                raise InvalidArgument(f"adapter {ref.name}: missing {names[0]} or its B")
            modules[(layer, target)] = (tensors.pop(names[0]), tensors.pop(names[1]))
    if tensors:
        raise InvalidArgument(f"adapter {ref.name}: unexpected tensors, e.g. {sorted(tensors)[:3]}")
    rank = int(config["r"])
    return LoRAWeights(name=ref.name, rank=rank, scaling=float(config["lora_alpha"]) / rank, modules=modules)
