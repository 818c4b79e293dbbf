"""Where PEFT saves a LoRA adapter's tensors in each base-model family, and the rule that an adapter
may adapt only the language model. The registry validates adapters by it; the worker loads them by it.

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight                 Llama, Mistral, Qwen2
    base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_A.weight  LLaVA
    base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight
        LLaVA's vision tower: PEFT puts LoRA there too when target_modules are bare names like "q_proj"
    base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_A.weight  Qwen2-VL
    base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight                  Qwen2-VL's vision tower
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.common.errors import InvalidArgument


@dataclass(frozen=True)
class AdapterLayout:
    layers_prefix: str                     # decoder layer i's LoRA tensors live under f"{layers_prefix}.{i}."
    vision_prefixes: tuple[str, ...] = ()  # LoRA tensors under these adapt the vision tower or projector

    def tensor_name(self, layer: int, path: str, which: str) -> str:
        """path: a projection inside a decoder layer ("self_attn.q_proj"); which: "A" or "B"."""
        return f"{self.layers_prefix}.{layer}.{path}.lora_{which}.weight"


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


def refuse_vision_tensors(layout: AdapterLayout, tensor_names: Iterable[str], adapter: str) -> None:
    """InvalidArgument if any tensor adapts the vision tower or projector (served: the language model only)."""
    vision = sorted(name for name in tensor_names if name.startswith(layout.vision_prefixes))
    if vision:
        raise InvalidArgument(
            f"{adapter} adapts the vision tower or projector ({len(vision)} tensors, e.g. {vision[0]!r}); "
            "Tessera serves LoRA on the language model only. With PEFT, bare target_modules names such as "
            "'q_proj' (LLaVA) or 'qkv' (Qwen2-VL) also match the vision tower: name the language model's modules "
            "instead, e.g. "
            r"target_modules='.*language_model.*\.(q_proj|k_proj|v_proj|o_proj)'")
