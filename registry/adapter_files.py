"""Validation of a PEFT LoRA adapter directory against a base model, without torch or unpickling.

A servable adapter is ``adapter_config.json`` (peft_type LORA, r, lora_alpha, perhaps use_rslora,
rank_pattern and alpha_pattern: services/common/lora_config.py; target_modules: a list of projection
names, or a regex) plus ``adapter_model.safetensors`` holding, for every decoder layer i and every
target projection m, exactly (r: that module's rank, from rank_pattern or r):

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  [r, in_features]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  [out_features, r]
    base_model.model.model.layers.{i}.mlp.down_proj.lora_A.weight     [r, intermediate] ...

(names per model family in services/common/adapter_layout.py). A vision-language model's adapter may also
adapt its vision tower and projector: those tensors are checked against the base model's config.json and
counted (services/common/tower_lora.py); the language model must be adapted all the same. A task head's tensors (base_model.model.score.*, base_model.model.task_head.*)
may sit beside them: they are no LoRA tensors, and the head is derived from them and the config
(services/common/task_heads.py).

Pickle files (.bin, .pt, ...) are never opened: their mere presence without
safetensors is refused with a message saying so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from registry.base_model_files import read_json_object
from registry.records import SUPPORTED_TARGET_MODULES, BaseModelRecord, ModuleShape
from services.common.safetensors_header import TensorInfo, read_safetensors_header
from registry.trusted_paths import resolve_inside_roots
from services.common.adapter_layout import ADAPTER_LAYOUTS, CONFIG_FILE, WEIGHTS_FILE, AdapterLayout
from services.common.errors import InvalidArgument
from services.common.lora_config import LoraHyperparameters, parse_lora_hyperparameters
from services.common.task_heads import TaskHead, is_head_tensor, parse_task_head
from services.common.tower_lora import TowerModule, is_tower_tensor, parse_tower_lora, tower_modules

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

# Which block of a decoder layer holds each projection (PEFT keeps the module path in tensor names).
PROJECTION_BLOCK: dict[str, str] = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}
assert tuple(PROJECTION_BLOCK) == SUPPORTED_TARGET_MODULES


def _path(module: str) -> str:
    """A projection's path inside a decoder layer: "self_attn.q_proj"."""
    return f"{PROJECTION_BLOCK[module]}.{module}"

@dataclasses.dataclass(frozen=True, slots=True)
class AdapterSource:
    """The two files of an adapter directory, resolved inside the import roots."""

    config_path: Path
    weights_path: Path


@dataclasses.dataclass(frozen=True, slots=True)
class LoraSpec:
    rank: int     # the largest of its modules' ranks (r, or a rank_pattern value): what workers batch by
    alpha: float  # lora_alpha (alpha_pattern may give some modules another)
    target_modules: tuple[str, ...]  # in SUPPORTED_TARGET_MODULES order; () while named by a regex
    task_head: TaskHead | None       # the head it carries in place of the LM head; None: it generates text
    tower_lora_params: int = 0       # its LoRA parameters on the vision tower and projector


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


def _names_a_tower_module(name: str, tower: Mapping[str, TowerModule]) -> bool:
    """PEFT's rule for a listed name: the module's name is it, or ends with "." + it ("qkv", "merger.mlp.0")."""
    return any(module == name or module.endswith("." + name) for module in tower)


def _target_modules(value: Any, tower: Mapping[str, TowerModule]) -> tuple[str, ...]:
    """PEFT saves a list of module names, or one string: a module name, or a regex matched against
    full module paths (() here: the tensors tell which projections it matched). Names of the vision
    tower's linears (`tower`) may be listed beside the language model's; their tensors are checked apart."""
    if isinstance(value, str) and value not in SUPPORTED_TARGET_MODULES:
        return ()
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise InvalidArgument(f"{CONFIG_FILE}: target_modules must be a non-empty list of module names, got {value!r}")
    for name in names:
        if name not in SUPPORTED_TARGET_MODULES and not _names_a_tower_module(name, tower):
            raise InvalidArgument(
                f"{CONFIG_FILE}: target module {name!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_TARGET_MODULES)}")
    return tuple(m for m in SUPPORTED_TARGET_MODULES if m in names)


def module_ranks(hyperparameters: LoraHyperparameters, targets: Sequence[str], layout: AdapterLayout,
                 num_layers: int) -> dict[tuple[int, str], int]:
    """(layer, projection) -> its rank: PEFT's rank_pattern matched against the module's name, else r."""
    return {(layer, module): hyperparameters.rank_of(layout.module_name(layer, _path(module)))
            for layer in range(num_layers) for module in targets}


def check_rank_fits(ranks: Mapping[tuple[int, str], int], module_shapes: Mapping[str, ModuleShape]) -> None:
    """r above a target's smaller side adds parameters but no rank: a typo, or an oversized upload."""
    for (layer, module), rank in ranks.items():
        shape = module_shapes[module]
        if rank > min(shape.in_features, shape.out_features):
            raise InvalidArgument(
                f"{CONFIG_FILE}: r={rank} exceeds the base model's {module} "
                f"({shape.in_features} -> {shape.out_features}); r may be at most "
                f"{min(shape.in_features, shape.out_features)} (layer {layer})")


def _expected_tensors(ranks: Mapping[tuple[int, str], int], layout: AdapterLayout,
                      module_shapes: Mapping[str, ModuleShape]) -> dict[str, tuple[str, tuple[int, int]]]:
    """Tensor name -> (projection, shape) for every layer x target: A is [r, in], B is [out, r]."""
    expected: dict[str, tuple[str, tuple[int, int]]] = {}
    for (layer, module), rank in ranks.items():
        shape = module_shapes[module]
        expected[layout.tensor_name(layer, _path(module), "A")] = (module, (rank, shape.in_features))
        expected[layout.tensor_name(layer, _path(module), "B")] = (module, (shape.out_features, rank))
    return expected


def _regex_targets(tensors: Mapping[str, TensorInfo], layout: AdapterLayout) -> tuple[str, ...]:
    """The projections a regex target_modules matched: those with a LoRA A tensor in the first layer."""
    found = tuple(m for m in SUPPORTED_TARGET_MODULES
                  if layout.tensor_name(0, _path(m), "A") in tensors)
    if not found:
        raise InvalidArgument(f"{CONFIG_FILE}: target_modules matched no projection of the language model's "
                              f"first layer ({', '.join(SUPPORTED_TARGET_MODULES)})")
    return found


def _tensor_rank(name: str, shape: tuple[int, ...]) -> int | None:
    if len(shape) != 2:
        return None
    return shape[0] if name.endswith(".lora_A.weight") else shape[1]


def check_lora_tensors(tensors: Mapping[str, TensorInfo], ranks: Mapping[tuple[int, str], int], layout: AdapterLayout,
                       module_shapes: Mapping[str, ModuleShape]) -> None:
    """Every layer x target must be present with its rank and the base model's shapes, and nothing else."""
    expected = _expected_tensors(ranks, layout, module_shapes)
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
        tensor_rank, rank = _tensor_rank(name, actual), _tensor_rank(name, shape)
        if tensor_rank is not None and tensor_rank != rank:
            raise InvalidArgument(
                f"rank mismatch: {CONFIG_FILE} says r={rank} but tensor {name!r} has rank "
                f"{tensor_rank} (shape {list(actual)})")
        raise InvalidArgument(
            f"tensor {name!r} has shape {list(actual)}, expected {list(shape)} for the base model's "
            f"{module} ({module_shapes[module].in_features} -> {module_shapes[module].out_features})")


def validate_adapter_dir(directory: Path, base: BaseModelRecord) -> LoraSpec:
    """Check a (trusted, already staged) adapter directory against a base model; returns its LoRA spec and
    the task head its files carry."""
    layout = ADAPTER_LAYOUTS[base.architecture]
    config = read_json_object(directory / CONFIG_FILE)
    tensors = read_safetensors_header(directory / WEIGHTS_FILE)
    hyperparameters = parse_lora_hyperparameters(config)
    # The tower's linears come from the base model's own config.json (its spec holds the language model's).
    tower = tower_modules(base.architecture, read_json_object(Path(base.path) / "config.json")) \
        if layout.vision_prefixes else {}
    tower_lora = parse_tower_lora(layout, {name: info.shape for name, info in tensors.items()}, tower,
                                  hyperparameters, WEIGHTS_FILE)
    # A task head's tensors answer to its declaration (parse_task_head below), the tower's to tower_lora.py.
    lora = {name: info for name, info in tensors.items() if not is_head_tensor(name) and not is_tower_tensor(layout, name)}
    targets = _target_modules(config.get("target_modules"), tower) or _regex_targets(lora, layout)
    ranks = module_ranks(hyperparameters, targets, layout, base.num_layers)
    check_rank_fits(ranks, base.module_shapes)
    check_lora_tensors(lora, ranks, layout, base.module_shapes)
    task_head = parse_task_head(config, {name: info.shape for name, info in tensors.items()}, base.hidden_size,
                                CONFIG_FILE)
    return LoraSpec(rank=max(ranks.values()), alpha=hyperparameters.lora_alpha, target_modules=targets,
                    task_head=task_head, tower_lora_params=tower_lora.params if tower_lora is not None else 0)
