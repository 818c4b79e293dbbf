"""Where PEFT saves a LoRA adapter's tensors in each base-model family. The registry validates adapters by
it; the worker loads them by it.

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight                 Llama, Mistral, Qwen2
    base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_A.weight  LLaVA
    base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight
        LLaVA's vision tower: PEFT puts LoRA there too when target_modules are bare names like "q_proj"
    base_model.model.model.multi_modal_projector.linear_1.lora_A.weight            LLaVA's projector
    base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_A.weight  Qwen2-VL
    base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight                  Qwen2-VL's vision tower
    base_model.model.model.visual.merger.mlp.0.lora_A.weight                       and its patch merger

Tensors under a layout's `vision_prefixes` are tower LoRA: which modules are served there, and their
shapes, is services/common/tower_lora.py's. A text model has no tower: such tensors are unexpected there.

Also the stored adapter's two files and the content address over both (`content_digest`); its LoRA
hyper-parameters: services/common/lora_config.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path


CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel's prefix before the base model's module names
DIGEST_SCHEME = "tessera-adapter-v1"
_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class AdapterLayout:
    layers_prefix: str                     # decoder layer i's LoRA tensors live under f"{layers_prefix}.{i}."
    vision_prefixes: tuple[str, ...] = ()  # LoRA tensors under these adapt the vision tower or projector

    def __post_init__(self) -> None:
        assert self.layers_prefix.startswith(PEFT_PREFIX), self.layers_prefix

    def module_name(self, layer: int, path: str) -> str:
        """PEFT's name for a projection inside a decoder layer (path: "self_attn.q_proj"), which its
        rank_pattern and alpha_pattern keys match: "model.layers.3.self_attn.q_proj"."""
        return f"{self.layers_prefix.removeprefix(PEFT_PREFIX)}.{layer}.{path}"

    def tensor_name(self, layer: int, path: str, which: str) -> str:
        """which: "A" or "B"."""
        return f"{PEFT_PREFIX}{self.module_name(layer, path)}.lora_{which}.weight"


TEXT_LAYOUT = AdapterLayout("base_model.model.model.layers")
LLAVA_LAYOUT = AdapterLayout("base_model.model.model.language_model.layers",
                             ("base_model.model.model.vision_tower.", "base_model.model.model.multi_modal_projector."))
QWEN2VL_LAYOUT = AdapterLayout("base_model.model.model.language_model.layers", ("base_model.model.model.visual.",))

# config.json `architectures[0]` -> its adapters' layout.
ADAPTER_LAYOUTS: dict[str, AdapterLayout] = {
    "LlamaForCausalLM": TEXT_LAYOUT,
    "MistralForCausalLM": TEXT_LAYOUT,
    "Qwen2ForCausalLM": TEXT_LAYOUT,
    "LlavaForConditionalGeneration": LLAVA_LAYOUT,
    "Qwen2VLForConditionalGeneration": QWEN2VL_LAYOUT,
}


def content_digest(config_sha256: str, weights_sha256: str) -> str:
    """An adapter's content address (common.proto Adapter.sha256): the sha256 of a manifest naming both
    files' sha256, so a change to either file, alpha included, changes the address:

        tessera-adapter-v1
        adapter_config.json 5d41402a...
        adapter_model.safetensors 7c211433...
    """
    manifest = f"{DIGEST_SCHEME}\n{CONFIG_FILE} {config_sha256}\n{WEIGHTS_FILE} {weights_sha256}\n"
    return hashlib.sha256(manifest.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def directory_digest(directory: Path) -> str:
    """The content address of the adapter in `directory` (its two files, streamed)."""
    return content_digest(file_sha256(directory / CONFIG_FILE), file_sha256(directory / WEIGHTS_FILE))

