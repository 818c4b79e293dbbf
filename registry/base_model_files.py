"""Read a Llama-family (or LLaVA) base model checkpoint directory's config.json into a spec.

The spec records, for every LoRA-targetable projection, its weight's
[out_features, in_features], so adapters can be checked against the base model
without loading it. Example (Llama-3-8B: hidden 4096, 32 heads, 8 kv heads,
head_dim 128, intermediate 14336): q_proj 4096 -> 4096, k_proj 4096 -> 1024,
down_proj 14336 -> 4096. For a vision-language model the spec is its language model's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from registry.records import ModuleShape
from services.common.architectures import SERVED_ARCHITECTURES
from services.common.errors import InvalidArgument
from services.common.strict_json import loads as strict_json_loads

SUPPORTED_ARCHITECTURES: tuple[str, ...] = SERVED_ARCHITECTURES
# Vision-language checkpoints keep their language model's settings in a nested config.
TEXT_CONFIG_KEYS: dict[str, str] = {"LlavaForConditionalGeneration": "text_config",
                                    "Qwen2VLForConditionalGeneration": "text_config"}
# transformers may save a nested config as its difference from the defaults (llava-hf's LLaVA-1.5
# text_config names only vocab_size, max_position_embeddings, ...): LlamaConfig's defaults fill in.
LLAMA_DEFAULTS: dict[str, int] = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                                  "num_attention_heads": 32, "max_position_embeddings": 2048, "vocab_size": 32000}
MAX_CONFIG_BYTES = 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class BaseModelSpec:
    architecture: str
    max_context: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    module_shapes: dict[str, ModuleShape]


def read_json_object(path: Path, limit: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    """A small JSON file that must hold an object (strict JSON: no NaN/Infinity, bounded nesting);
    InvalidArgument (naming the file) otherwise."""
    if not path.is_file():
        raise InvalidArgument(f"{path.name} is missing from {path.parent}")
    if path.stat().st_size > limit:
        raise InvalidArgument(f"{path} is larger than {limit} bytes")
    data = strict_json_loads(path.read_bytes(), path.name)
    if not isinstance(data, dict):
        raise InvalidArgument(f"{path.name} must hold a JSON object")
    return data


def _positive_int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def projection_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, ModuleShape]:
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": ModuleShape(hidden, q_out),
        "k_proj": ModuleShape(hidden, kv_out),
        "v_proj": ModuleShape(hidden, kv_out),
        "o_proj": ModuleShape(q_out, hidden),
        "gate_proj": ModuleShape(hidden, intermediate),
        "up_proj": ModuleShape(hidden, intermediate),
        "down_proj": ModuleShape(intermediate, hidden),
    }


def _language_model_config(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    key = TEXT_CONFIG_KEYS.get(architecture)
    if key is None:
        return config
    text = config.get(key)
    if not isinstance(text, dict):
        raise InvalidArgument(f"config.json: {architecture} needs a {key} object")
    return {**LLAMA_DEFAULTS, **text} if text.get("model_type", "llama") == "llama" else text


def read_base_model_spec(model_dir: Path) -> BaseModelSpec:
    """Spec of the checkpoint in `model_dir` (a trusted, resolved directory)."""
    if not model_dir.is_dir():
        raise InvalidArgument(f"base model path {str(model_dir)!r} is not a directory")
    config = read_json_object(model_dir / "config.json")
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise InvalidArgument(
            f"config.json: architectures {architectures!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    architecture = architectures[0]
    config = _language_model_config(config, architecture)
    if not any(model_dir.glob("*.safetensors")):
        raise InvalidArgument(f"{model_dir} holds no *.safetensors weights (pickle checkpoints are refused)")
    hidden = _positive_int(config, "hidden_size")
    heads = _positive_int(config, "num_attention_heads")
    kv_heads = _positive_int(config, "num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
    head_dim = _positive_int(config, "head_dim") if config.get("head_dim") is not None else hidden // heads
    return BaseModelSpec(
        architecture=architecture,
        max_context=_positive_int(config, "max_position_embeddings"),
        vocab_size=_positive_int(config, "vocab_size"),
        hidden_size=hidden,
        num_layers=_positive_int(config, "num_hidden_layers"),
        module_shapes=projection_shapes(
            hidden, _positive_int(config, "intermediate_size"), heads, kv_heads, head_dim),
    )
