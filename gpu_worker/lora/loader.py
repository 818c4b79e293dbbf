"""Reads a PEFT LoRA adapter from the adapter store, safely.

Safety rules (DESIGN invariants): the directory must resolve inside the configured store root;
weights are read only from adapter_model.safetensors (a pickle `.bin` is never unpickled); the
file's sha256 must equal the registry's record, and the tensors are parsed from the very bytes
that were hashed, so the file cannot change between check and use.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from services.errors import FailedPrecondition, InvalidArgument, PermissionDenied

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
# PEFT's saved name of a LoRA matrix, e.g. base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
PEFT_TENSOR_NAME = "base_model.model.model.layers.{layer}.{path}.lora_{which}.weight"


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


def load_adapter(ref: AdapterRef, store_root: Path, layer_paths: dict[str, str], num_layers: int) -> LoRAWeights:
    """Load and verify `ref`. `layer_paths`: PEFT target name -> module path in a decoder layer."""
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

    targets = sorted(config["target_modules"])
    unknown = [t for t in targets if t not in layer_paths]
    if unknown:
        raise InvalidArgument(f"adapter {ref.name}: target modules {unknown} are not served")
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in range(num_layers):
        for target in targets:
            names = [PEFT_TENSOR_NAME.format(layer=layer, path=layer_paths[target], which=w) for w in "AB"]
            if not all(name in tensors for name in names):
                raise InvalidArgument(f"adapter {ref.name}: missing {names[0]} or its B")
            modules[(layer, target)] = (tensors.pop(names[0]), tensors.pop(names[1]))
    if tensors:
        raise InvalidArgument(f"adapter {ref.name}: unexpected tensors, e.g. {sorted(tensors)[:3]}")
    rank = int(config["r"])
    return LoRAWeights(name=ref.name, rank=rank, scaling=float(config["lora_alpha"]) / rank, modules=modules)
