"""Validation of a PEFT LoRA adapter directory against a base model, without torch or unpickling.

A servable adapter is ``adapter_config.json`` (peft_type LORA, r, lora_alpha,
target_modules: a list of projection names, or a regex) plus ``adapter_model.safetensors``
holding, for every decoder layer i and every target projection m, exactly:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  [r, in_features]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  [out_features, r]
    base_model.model.model.layers.{i}.mlp.down_proj.lora_A.weight     [r, intermediate] ...

(names per model family in services/common/adapter_layout.py; a vision-language model's adapters may adapt
its language model only).

Pickle files (.bin, .pt, ...) are never opened: their mere presence without
safetensors is refused with a message saying so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from registry.base_model_files import read_json_object
from registry.records import SUPPORTED_TARGET_MODULES, ModuleShape
from registry.safetensors_header import TensorInfo, read_safetensors_header
from registry.trusted_paths import resolve_inside_roots
from services.common.adapter_layout import (ADAPTER_LAYOUTS, CONFIG_FILE, WEIGHTS_FILE, AdapterLayout,
                                            check_lora_hyperparameters, refuse_vision_tensors)
from services.common.errors import InvalidArgument

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

# Which block of a decoder layer holds each projection (PEFT keeps the module path in tensor names).
PROJECTION_BLOCK: dict[str, str] = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}
assert tuple(PROJECTION_BLOCK) == SUPPORTED_TARGET_MODULES

# PEFT options that change the adapter's math; serving them as plain LoRA would give wrong outputs.
UNSUPPORTED_OPTIONS: dict[str, str] = {
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "use_dora": "use_dora (DoRA)",
    "layers_to_transform": "layers_to_transform (LoRA on a subset of layers)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
    "use_rslora": "use_rslora (rank-stabilised scaling)",
    "lora_bias": "lora_bias (a bias on lora_B)",
    "fan_in_fan_out": "fan_in_fan_out (transposed weights)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters",
}


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterSource:
    """The two files of an adapter directory, resolved inside the import roots."""

    config_path: Path
    weights_path: Path


@dataclasses.dataclass(frozen=True, slots=True)
class LoraSpec:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # in SUPPORTED_TARGET_MODULES order; () while named by a regex


def locate_adapter_files(source_dir: str, roots: Sequence[Path]) -> AdapterSource:
    """Find the config and safetensors of `source_dir`; refuse paths escaping `roots` and pickle-only adapters."""
    directory = resolve_inside_roots(source_dir, roots, "adapter directory")
    if not directory.is_dir():
        raise InvalidArgument(f"adapter directory {source_dir!r} does not exist or is not a directory")
    weights = directory / WEIGHTS_FILE
    if not weights.exists():
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise InvalidArgument(
                f"adapter directory {source_dir!r} holds {', '.join(pickles)} but no {WEIGHTS_FILE}: "
                "pickle adapters are refused; convert to safetensors")
        raise InvalidArgument(f"adapter directory {source_dir!r} has no {WEIGHTS_FILE}")
    if not (directory / CONFIG_FILE).exists():
        raise InvalidArgument(f"adapter directory {source_dir!r} has no {CONFIG_FILE}")
    paths = [resolve_inside_roots(directory / name, roots, f"adapter file {name}")
             for name in (CONFIG_FILE, WEIGHTS_FILE)]
    for path in paths:
        if not path.is_file():
            raise InvalidArgument(f"{path.name} in {source_dir!r} is not a regular file")
    return AdapterSource(config_path=paths[0], weights_path=paths[1])


def _target_modules(value: Any) -> tuple[str, ...]:
    """PEFT saves a list of module names, or one string: a module name, or a regex matched against
    full module paths (() here: the tensors tell which projections it matched)."""
    if isinstance(value, str) and value not in SUPPORTED_TARGET_MODULES:
        return ()
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise InvalidArgument(f"{CONFIG_FILE}: target_modules must be a non-empty list of module names, got {value!r}")
    for name in names:
        if name not in SUPPORTED_TARGET_MODULES:
            raise InvalidArgument(
                f"{CONFIG_FILE}: target module {name!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_TARGET_MODULES)}")
    return tuple(m for m in SUPPORTED_TARGET_MODULES if m in names)


def parse_lora_config(config: Mapping[str, Any]) -> LoraSpec:
    """The LoRA hyper-parameters of an adapter_config.json; InvalidArgument on anything we cannot serve."""
    if config.get("peft_type") != "LORA":
        raise InvalidArgument(f"{CONFIG_FILE}: peft_type must be 'LORA', got {config.get('peft_type')!r}")
    rank, alpha = check_lora_hyperparameters(config.get("r"), config.get("lora_alpha"), CONFIG_FILE)
    for key, description in UNSUPPORTED_OPTIONS.items():
        if config.get(key):
            raise InvalidArgument(f"{CONFIG_FILE}: {description} is not supported; Tessera serves plain LoRA")
    if config.get("bias", "none") != "none":
        raise InvalidArgument(f"{CONFIG_FILE}: bias={config['bias']!r} is not supported; only 'none'")
    return LoraSpec(rank=rank, alpha=alpha, target_modules=_target_modules(config.get("target_modules")))


def check_rank_fits(spec: LoraSpec, module_shapes: Mapping[str, ModuleShape]) -> None:
    """r above a target's smaller side adds parameters but no rank: a typo, or an oversized upload."""
    for module in spec.target_modules:
        shape = module_shapes[module]
        if spec.rank > min(shape.in_features, shape.out_features):
            raise InvalidArgument(
                f"{CONFIG_FILE}: r={spec.rank} exceeds the base model's {module} "
                f"({shape.in_features} -> {shape.out_features}); r may be at most "
                f"{min(shape.in_features, shape.out_features)}")


def _expected_tensors(spec: LoraSpec, layout: AdapterLayout, num_layers: int,
                      module_shapes: Mapping[str, ModuleShape]) -> dict[str, tuple[str, tuple[int, int]]]:
    """Tensor name -> (projection, shape) for every layer x target: A is [r, in], B is [out, r]."""
    expected: dict[str, tuple[str, tuple[int, int]]] = {}
    for layer in range(num_layers):
        for module in spec.target_modules:
            shape = module_shapes[module]
            path = f"{PROJECTION_BLOCK[module]}.{module}"
            expected[layout.tensor_name(layer, path, "A")] = (module, (spec.rank, shape.in_features))
            expected[layout.tensor_name(layer, path, "B")] = (module, (shape.out_features, spec.rank))
    return expected


def _regex_targets(tensors: Mapping[str, TensorInfo], layout: AdapterLayout) -> tuple[str, ...]:
    """The projections a regex target_modules matched: those with a LoRA A tensor in the first layer."""
    found = tuple(m for m in SUPPORTED_TARGET_MODULES
                  if layout.tensor_name(0, f"{PROJECTION_BLOCK[m]}.{m}", "A") in tensors)
    if not found:
        raise InvalidArgument(f"{CONFIG_FILE}: target_modules matched no projection of the language model's "
                              f"first layer ({', '.join(SUPPORTED_TARGET_MODULES)})")
    return found


def _tensor_rank(name: str, shape: tuple[int, ...]) -> int | None:
    if len(shape) != 2:
        return None
    return shape[0] if name.endswith(".lora_A.weight") else shape[1]


def check_lora_tensors(tensors: Mapping[str, TensorInfo], spec: LoraSpec, layout: AdapterLayout, num_layers: int,
                       module_shapes: Mapping[str, ModuleShape]) -> None:
    """Every layer x target must be present with exactly the base model's shapes, and nothing else."""
    expected = _expected_tensors(spec, layout, num_layers, module_shapes)
    missing = [name for name in expected if name not in tensors]
    if missing:
        module = expected[missing[0]][0]
        raise InvalidArgument(
            f"{CONFIG_FILE} targets {module!r} but {WEIGHTS_FILE} lacks tensor {missing[0]!r} "
            f"({len(missing)} expected tensors missing)")
    unexpected = sorted(name for name in tensors if name not in expected)
    if unexpected:
        raise InvalidArgument(
            f"{WEIGHTS_FILE} holds tensor {unexpected[0]!r} that is not a LoRA weight of a target module "
            f"in {CONFIG_FILE} ({len(unexpected)} unexpected tensors)")
    for name, (module, shape) in expected.items():
        actual = tensors[name].shape
        if actual == shape:
            continue
        tensor_rank = _tensor_rank(name, actual)
        if tensor_rank is not None and tensor_rank != spec.rank:
            raise InvalidArgument(
                f"rank mismatch: {CONFIG_FILE} says r={spec.rank} but tensor {name!r} has rank "
                f"{tensor_rank} (shape {list(actual)})")
        raise InvalidArgument(
            f"tensor {name!r} has shape {list(actual)}, expected {list(shape)} for the base model's "
            f"{module} ({module_shapes[module].in_features} -> {module_shapes[module].out_features})")


def validate_adapter_dir(directory: Path, architecture: str, num_layers: int,
                         module_shapes: Mapping[str, ModuleShape]) -> LoraSpec:
    """Check a (trusted, already staged) adapter directory against a base model; returns its LoRA spec."""
    layout = ADAPTER_LAYOUTS[architecture]
    config = read_json_object(directory / CONFIG_FILE)
    tensors = read_safetensors_header(directory / WEIGHTS_FILE)
    # First: bare target names ("q_proj") that also reached a vision tower deserve this message.
    refuse_vision_tensors(layout, tensors, WEIGHTS_FILE)
    spec = parse_lora_config(config)
    if not spec.target_modules:
        spec = dataclasses.replace(spec, target_modules=_regex_targets(tensors, layout))
    check_rank_fits(spec, module_shapes)
    check_lora_tensors(tensors, spec, layout, num_layers, module_shapes)
    return spec
