"""LoRA on a vision-language model's vision tower and projector: the linears PEFT may adapt there, their
shapes from the base model's config.json, and an adapter's tower spec from its tensor shapes. The registry
validates and counts an adapter's tower LoRA by it; the worker loads it by it.

Modules are PEFT's own names (a tensor's name less "base_model.model." and ".lora_A.weight"):

    LLaVA     model.vision_tower.encoder.layers.{i}.self_attn.{q,k,v,out}_proj   [vision hidden -> vision hidden]
              model.vision_tower.encoder.layers.{i}.mlp.fc1 / fc2                 [hidden <-> intermediate]
              model.multi_modal_projector.linear_1 / linear_2                     [vision hidden x feature layers
                                                                                   -> text hidden -> text hidden]
    Qwen2-VL  model.visual.blocks.{i}.attn.qkv / attn.proj                        [embed -> 3 embed / embed -> embed]
              model.visual.blocks.{i}.mlp.fc1 / fc2                               [embed <-> embed x mlp_ratio]
              model.visual.merger.mlp.0 / mlp.2                                   [embed x merge^2 -> same -> hidden]

PEFT with bare target names ("q_proj", "qkv", "fc1") adapts these beside the language model's projections.
Anything else under the tower (Qwen2-VL's patch_embed.proj, a Conv3d that "proj" also matches) is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.common.adapter_layout import PEFT_PREFIX, AdapterLayout
from services.common.errors import InvalidArgument
from services.common.lora_config import LoraHyperparameters

_LORA_TENSOR = re.compile(rf"{re.escape(PEFT_PREFIX)}(.+)\.lora_([AB])\.weight")

# transformers' defaults for keys a saved config may leave out (it saves a nested config as its difference).
_CLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12}
_LLAMA_HIDDEN = 4096
_QWEN2VL_VISION_DEFAULTS = {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4,
                            "spatial_merge_size": 2}


@dataclass(frozen=True)
class TowerModule:
    """A linear of the tower or projector that LoRA may adapt."""
    in_features: int
    out_features: int


@dataclass(frozen=True)
class TowerLoraModule:
    """One adapted tower linear: A [rank, in], B [out, rank], delta = x @ A^T @ B^T * scaling."""
    name: str  # PEFT's module name: "model.vision_tower.encoder.layers.0.self_attn.q_proj"
    rank: int
    scaling: float
    in_features: int
    out_features: int

    @property
    def tensor_names(self) -> tuple[str, str]:
        """(A, B) as PEFT saves them."""
        return f"{PEFT_PREFIX}{self.name}.lora_A.weight", f"{PEFT_PREFIX}{self.name}.lora_B.weight"

    @property
    def tensors(self) -> tuple[tuple[str, tuple[int, int]], tuple[str, tuple[int, int]]]:
        """(A's name, [rank, in]), (B's name, [out, rank])."""
        a, b = self.tensor_names
        return (a, (self.rank, self.in_features)), (b, (self.out_features, self.rank))

    @property
    def params(self) -> int:
        return self.rank * (self.in_features + self.out_features)


@dataclass(frozen=True)
class TowerLoraSpec:
    modules: tuple[TowerLoraModule, ...]  # sorted by name: the order of a packed copy's tower tensors

    @property
    def params(self) -> int:
        """Its LoRA parameters on the tower and projector (Adapter.tower_lora_params)."""
        return sum(module.params for module in self.modules)

    @property
    def tensors(self) -> tuple[tuple[str, tuple[int, int]], ...]:
        """(PEFT tensor name, shape) of every A and B, in packing order."""
        return tuple(tensor for module in self.modules for tensor in module.tensors)


def _int(config: Mapping[str, Any], key: str, defaults: Mapping[str, int]) -> int:
    value = config.get(key, defaults.get(key))
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _section(config: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    section = config.get(key, {})
    if not isinstance(section, dict):
        raise InvalidArgument(f"config.json: {key} must be an object")
    return section


def _llava_modules(config: Mapping[str, Any]) -> dict[str, TowerModule]:
    vision = _section(config, "vision_config")
    hidden, inner = _int(vision, "hidden_size", _CLIP_DEFAULTS), _int(vision, "intermediate_size", _CLIP_DEFAULTS)
    text_hidden = _int(_section(config, "text_config"), "hidden_size", {"hidden_size": _LLAMA_HIDDEN})
    feature_layer = config.get("vision_feature_layer", -2)
    features = len(feature_layer) if isinstance(feature_layer, list) else 1  # the projector takes them concatenated
    modules = {}
    for i in range(_int(vision, "num_hidden_layers", _CLIP_DEFAULTS)):
        layer = f"model.vision_tower.encoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            modules[f"{layer}.self_attn.{proj}"] = TowerModule(hidden, hidden)
        modules[f"{layer}.mlp.fc1"] = TowerModule(hidden, inner)
        modules[f"{layer}.mlp.fc2"] = TowerModule(inner, hidden)
    modules["model.multi_modal_projector.linear_1"] = TowerModule(hidden * features, text_hidden)
    modules["model.multi_modal_projector.linear_2"] = TowerModule(text_hidden, text_hidden)
    return modules


def _qwen2vl_modules(config: Mapping[str, Any]) -> dict[str, TowerModule]:
    vision = _section(config, "vision_config")
    embed = _int(vision, "embed_dim", _QWEN2VL_VISION_DEFAULTS)
    inner = embed * _int(vision, "mlp_ratio", _QWEN2VL_VISION_DEFAULTS)
    merged = embed * _int(vision, "spatial_merge_size", _QWEN2VL_VISION_DEFAULTS) ** 2
    modules = {}
    for i in range(_int(vision, "depth", _QWEN2VL_VISION_DEFAULTS)):
        block = f"model.visual.blocks.{i}"
        modules[f"{block}.attn.qkv"] = TowerModule(embed, 3 * embed)
        modules[f"{block}.attn.proj"] = TowerModule(embed, embed)
        modules[f"{block}.mlp.fc1"] = TowerModule(embed, inner)
        modules[f"{block}.mlp.fc2"] = TowerModule(inner, embed)
    modules["model.visual.merger.mlp.0"] = TowerModule(merged, merged)
    modules["model.visual.merger.mlp.2"] = TowerModule(merged, _int(vision, "hidden_size", _QWEN2VL_VISION_DEFAULTS))
    return modules


_FAMILIES = {"LlavaForConditionalGeneration": _llava_modules, "Qwen2VLForConditionalGeneration": _qwen2vl_modules}


def tower_modules(architecture: str, config: Mapping[str, Any]) -> dict[str, TowerModule]:
    """PEFT module name -> shape of every tower linear LoRA may adapt, from config.json; {} for a text model."""
    family = _FAMILIES.get(architecture)
    return family(config) if family is not None else {}


def is_tower_tensor(layout: AdapterLayout, name: str) -> bool:
    return name.startswith(layout.vision_prefixes)


def parse_tower_lora(layout: AdapterLayout, shapes: Mapping[str, tuple[int, ...]],
                     modules: Mapping[str, TowerModule], hyperparameters: LoraHyperparameters,
                     where: str) -> TowerLoraSpec | None:
    """The tower LoRA of an adapter whose tensors have `shapes` (all of them: those off the tower are
    skipped); None when it has none. Each module's rank and scaling are PEFT's (rank_pattern,
    alpha_pattern, rsLoRA). InvalidArgument naming the tensor: a module that is not served, A without B,
    a shape that is not the base model's, a rank other than the config's. `where`: the file, for messages."""
    found: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        if not is_tower_tensor(layout, name):
            continue
        match = _LORA_TENSOR.fullmatch(name)
        if match is None or match.group(1) not in modules:
            raise InvalidArgument(
                f"{where}: tensor {name!r} adapts a vision module Tessera does not serve; tower LoRA is served on "
                "the vision tower's attention and MLP linears and the projector (docs/tower-lora.md)")
        found.setdefault(match.group(1), {})[match.group(2)] = tuple(shape)
    adapted = []
    for module, pair in sorted(found.items()):
        base, rank = modules[module], hyperparameters.rank_of(module)
        spec = TowerLoraModule(module, rank, hyperparameters.scaling_of(module), base.in_features, base.out_features)
        if rank > min(base.in_features, base.out_features):
            raise InvalidArgument(f"{where}: r={rank} exceeds {module} ({base.in_features} -> {base.out_features})")
        for (name, expected), which in zip(spec.tensors, "AB"):
            if which not in pair:
                raise InvalidArgument(f"{where}: {module} has a lora_{'B' if which == 'A' else 'A'} but no {name!r}")
            actual = pair[which]
            if actual != expected:
                actual_rank = actual[0 if which == "A" else 1] if len(actual) == 2 else None
                problem = (f"rank mismatch: the config says r={rank}" if actual_rank not in (None, rank) else
                           f"expected {list(expected)} for the base model's {module} "
                           f"({base.in_features} -> {base.out_features})")
                raise InvalidArgument(f"{where}: tensor {name!r} has shape {list(actual)}; {problem}")
        adapted.append(spec)
    return TowerLoraSpec(tuple(adapted)) if adapted else None
