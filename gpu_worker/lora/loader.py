"""Reads a PEFT LoRA adapter from the adapter store, safely.

Safety rules (DESIGN invariants): the directory must resolve inside the configured store root;
weights are read only from adapter_model.safetensors (a pickle `.bin` is never unpickled); the
content digest of adapter_config.json and the weights (services/common/adapter_layout.py) must equal
the registry's record, and both are parsed from the very bytes that were hashed, so neither file can
change between check and use. The config is strict JSON and its hyper-parameters are checked as at
registration (services/common/lora_config.py); each module gets the rank and scaling PEFT gives it
(rank_pattern, alpha_pattern, rsLoRA). A task head's tensors (services/common/task_heads.py) come with the
LoRA ones, and the head they make must be the one the registry recorded; so do a vision-language model's
tower LoRA tensors (services/common/tower_lora.py), whose parameter count must be the registry's. Errors name the cause, not the adapter: the adapter manager
names it. It runs on the adapter loader threads (lora/adapter_manager.py), never on the engine thread.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from services.common.adapter_layout import CONFIG_FILE, WEIGHTS_FILE, AdapterLayout, content_digest
from services.common.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from services.common.lora_config import LoraHyperparameters, parse_lora_hyperparameters
from services.common.safetensors_header import header_length, parse_header
from services.common.strict_json import loads as strict_json_loads
from services.common.task_heads import PEFT_MODULE_PREFIX, TaskHead, parse_task_head
from services.common.tower_lora import TowerLoraSpec, TowerModule, parse_tower_lora


@dataclass(frozen=True)
class AdapterRef:
    """What the registry says about an adapter (from the Adapter message)."""
    name: str
    base_model: str
    rank: int
    sha256: str         # content digest of adapter_config.json and adapter_model.safetensors
    storage_path: str
    registered_ms: int = 0  # when the registry registered it (a newer registration retries a failed load)
    head: TaskHead | None = None  # its task head, as the registry derived it from the files
    tower_lora_params: int = 0    # its LoRA parameters on the vision tower and projector, as the registry counted them


class LoRAModule(NamedTuple):
    """One adapted projection of one layer: its own rank and scaling (PEFT's rank_pattern, alpha_pattern, rsLoRA)."""
    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]
    scaling: float   # alpha / rank, or alpha / sqrt(rank) with rsLoRA


@dataclass(frozen=True)
class HeadWeights:
    head: TaskHead
    tensors: dict[str, torch.Tensor]  # by the head's tensor names ("score.weight"), in its packing order


@dataclass(frozen=True)
class TowerWeights:
    """An adapter's LoRA on the vision tower and projector."""
    spec: TowerLoraSpec
    tensors: dict[str, torch.Tensor]  # by PEFT tensor name, in spec.tensors' order

    def modules(self) -> dict[str, LoRAModule]:
        """PEFT module name ("model.visual.blocks.0.attn.qkv") -> its A, B and scaling."""
        return {m.name: LoRAModule(*(self.tensors[name] for name in m.tensor_names), m.scaling)
                for m in self.spec.modules}


@dataclass(frozen=True)
class LoRAWeights:
    """One loaded adapter: (layer, PEFT target) -> its module, its task head and its tower LoRA if it has them."""
    name: str
    modules: dict[tuple[int, str], LoRAModule]
    head: HeadWeights | None = None
    tower: TowerWeights | None = None

    @property
    def rank(self) -> int:
        """The largest of its modules' ranks (what the scheduler batches by, the registry records)."""
        return max(module.a.shape[0] for module in self.modules.values())


def resolve_in_store(storage_path: str, store_root: Path) -> Path:
    directory = Path(storage_path).expanduser().resolve()
    root = store_root.expanduser().resolve()
    if not directory.is_relative_to(root):
        raise PermissionDenied("its stored directory is outside the adapter store "
                               "(a worker's adapter_store must be the registry's)")
    return directory


def _parse_config(data: bytes) -> dict[str, Any]:
    config = strict_json_loads(data, CONFIG_FILE)
    if not isinstance(config, dict):
        raise InvalidArgument(f"{CONFIG_FILE} must hold a JSON object")
    return config


def _head_weights(ref: AdapterRef, config: dict[str, Any], tensors: dict[str, torch.Tensor], hidden_size: int) -> HeadWeights | None:
    """Take the head's tensors out of `tensors`; the head must be the registry's record of it."""
    head = parse_task_head(config, {name: tuple(t.shape) for name, t in tensors.items()}, hidden_size)
    if head != ref.head:
        raise FailedPrecondition(f"its files carry the task head {head}, the registry recorded {ref.head}; "
                                 "register it again")
    if head is None:
        return None
    return HeadWeights(head, {name: tensors.pop(PEFT_MODULE_PREFIX + name) for name, _ in head.tensors})


def _tower_weights(ref: AdapterRef, layout: AdapterLayout, tensors: dict[str, torch.Tensor],
                   tower: dict[str, TowerModule], hyperparameters: LoraHyperparameters) -> TowerWeights | None:
    """Take the tower LoRA's tensors out of `tensors`; its parameters must be the registry's count."""
    spec = parse_tower_lora(layout, {name: tuple(t.shape) for name, t in tensors.items()}, tower, hyperparameters,
                            WEIGHTS_FILE)
    params = spec.params if spec is not None else 0
    if params != ref.tower_lora_params:
        raise FailedPrecondition(f"its files carry {params} LoRA parameters on the vision tower and projector, the "
                                 f"registry recorded {ref.tower_lora_params}; register it again")
    if spec is None:
        return None
    return TowerWeights(spec, {name: tensors.pop(name) for name, _ in spec.tensors})


TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def _read_whole(path: Path) -> torch.Tensor:
    """The file's bytes (uint8) in a buffer nothing has touched before the read: a zero-filled one
    (bytearray) is written page by page while holding the GIL, 0.3 s for a 600 MB adapter during which
    the engine thread cannot launch; here the pages fault in inside readinto, which releases it."""
    with path.open("rb", buffering=0) as f:
        data = torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8)
        view, done = memoryview(data.numpy()), 0
        while done < len(view) and (n := f.readinto(view[done:])):
            done += n
        if done != len(view) or f.read(1):
            raise FailedPrecondition(f"{path.name} changed size while it was read")
    return data


def _tensor_views(weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """The safetensors file's tensors as views of its bytes `weights`: no copy. safetensors' own loader
    copies every tensor into a new bytes object while holding the GIL (a 600 MB adapter stops the
    engine thread for the whole copy); the one copy left is the packing's, which releases it."""
    length = header_length(weights[:8].numpy().tobytes(), len(weights), WEIGHTS_FILE)
    infos = parse_header(weights[8:8 + length].numpy().tobytes(), len(weights) - 8 - length, WEIGHTS_FILE)
    data_start, tensors = 8 + length, {}
    for name, info in infos.items():
        dtype = TORCH_DTYPES[info.dtype]
        raw = weights[data_start + info.begin:data_start + info.end]
        if (data_start + info.begin) % dtype.itemsize:  # a view must start at a multiple of its item size
            raw = raw.clone()
        tensors[name] = raw.view(dtype).view(info.shape)
    return tensors


def _verified_files(ref: AdapterRef, directory: Path) -> tuple[bytes, torch.Tensor]:
    """(config, weights) bytes, read once each, whose content digest is the registry's record."""
    config, weights = (directory / CONFIG_FILE).read_bytes(), _read_whole(directory / WEIGHTS_FILE)
    digest = content_digest(hashlib.sha256(config).hexdigest(), hashlib.sha256(weights.numpy()).hexdigest())
    if digest != ref.sha256.lower():
        raise FailedPrecondition(
            f"checksum mismatch: the stored {CONFIG_FILE} and {WEIGHTS_FILE} hash to "
            f"{digest[:16]}..., the registry recorded {ref.sha256[:16]}...; the stored files changed after "
            f"registration: register it again from good files (DELETE /admin/v1/adapters/{ref.name}, then POST "
            "/admin/v1/adapters), which replaces the stored copy; workers read it again at once")
    return config, weights


def _served_targets(tensors: dict[str, torch.Tensor], layout: AdapterLayout,
                    layer_paths: dict[str, str]) -> list[str]:
    """The PEFT target names the adapter adapts, read from its tensor names: adapter_config.json may
    name them by a regex (r".*language_model.*\\.(q_proj|v_proj)") rather than a list."""
    in_layer = re.compile(rf"{re.escape(layout.layers_prefix)}\.\d+\.(.+)\.lora_[AB]\.weight")
    paths = {match.group(1) for name in tensors if (match := in_layer.fullmatch(name))}
    unknown = sorted(paths - set(layer_paths.values()))
    if unknown:
        raise InvalidArgument(f"target modules {unknown} are not served")
    if not paths:
        raise InvalidArgument(f"no LoRA tensors under {layout.layers_prefix}")
    return sorted(target for target, path in layer_paths.items() if path in paths)


def load_adapter(ref: AdapterRef, store_root: Path, layout: AdapterLayout, layer_paths: dict[str, str],
                 num_layers: int, hidden_size: int, tower: dict[str, TowerModule] | None = None) -> LoRAWeights:
    """Load and verify `ref`. `layout`: where the base model's family keeps LoRA tensors;
    `layer_paths`: PEFT target name -> module path in a decoder layer, for the targets served;
    `hidden_size`: the language model's (a task head reads its hidden states); `tower`: the vision tower's
    adaptable linears (tower_lora.tower_modules; None or {}: a text model)."""
    directory = resolve_in_store(ref.storage_path, store_root)
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        if not (directory / name).is_file():
            pickled = (" (a pickle adapter_model.bin is there; it is never loaded)"
                       if name == WEIGHTS_FILE and (directory / "adapter_model.bin").exists() else "")
            raise FailedPrecondition(f"{name} not found in its stored directory{pickled}")
    config, weights = _verified_files(ref, directory)
    parsed = _parse_config(config)
    hyperparameters = parse_lora_hyperparameters(parsed)
    tensors = _tensor_views(weights)

    tower_weights = _tower_weights(ref, layout, tensors, tower or {}, hyperparameters)
    head = _head_weights(ref, parsed, tensors, hidden_size)
    targets = _served_targets(tensors, layout, layer_paths)
    modules: dict[tuple[int, str], LoRAModule] = {}
    for layer in range(num_layers):
        for target in targets:
            module = layout.module_name(layer, layer_paths[target])
            names = [layout.tensor_name(layer, layer_paths[target], which) for which in "AB"]
            if not all(name in tensors for name in names):
                raise InvalidArgument(f"missing {names[0]} or its B")
            a, b = tensors.pop(names[0]), tensors.pop(names[1])
            rank = hyperparameters.rank_of(module)
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
                raise InvalidArgument(f"{CONFIG_FILE} says r={rank} for {module} but {names[0]} has shape "
                                      f"{list(a.shape)} and its B {list(b.shape)}")
            modules[(layer, target)] = LoRAModule(a, b, hyperparameters.scaling_of(module))
    if tensors:
        raise InvalidArgument(f"unexpected tensors, e.g. {sorted(tensors)[:3]}")
    return LoRAWeights(ref.name, modules, head, tower_weights)
