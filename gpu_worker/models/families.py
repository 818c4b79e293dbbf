"""Which model family serves a checkpoint (by its config's model_type), and what loading it gives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoProcessor, PretrainedConfig, ProcessorMixin

from gpu_worker.models.checkpoint import iter_checkpoint
from gpu_worker.models.llama import LlamaForCausalLM, build_model
from gpu_worker.models.llava import load_llava
from gpu_worker.models.qwen2vl import load_qwen2vl
from gpu_worker.vision.images import ImageEncoder
from gpu_worker.vision.qwen2vl_processor import Qwen2VLPromptProcessor
from services.common.adapter_layout import LLAVA_LAYOUT, QWEN2VL_LAYOUT, TEXT_LAYOUT, AdapterLayout
from services.common.tower_lora import TowerModule, tower_modules


@dataclass(frozen=True)
class ServedModel:
    language_model: LlamaForCausalLM
    image_encoder: ImageEncoder | None  # vision-language models: a prompt's images -> its image tokens' features
    adapter_layout: AdapterLayout       # where PEFT saves this family's LoRA tensors
    # Vision-language models: chat messages with images -> token ids and pixel values (prompts.py).
    processor: ProcessorMixin | Qwen2VLPromptProcessor | None = None
    tower: dict[str, TowerModule] = field(default_factory=dict)  # the linears tower LoRA may adapt (none: text)


def _load_text(checkpoint_dir: Path, config: PretrainedConfig, device: torch.device,
               dtype: torch.dtype) -> ServedModel:
    model = build_model(config, iter_checkpoint(checkpoint_dir), str(checkpoint_dir), device=device, dtype=dtype)
    return ServedModel(model, None, TEXT_LAYOUT)


def _load_llava(checkpoint_dir: Path, config: PretrainedConfig, device: torch.device,
                dtype: torch.dtype) -> ServedModel:
    language, encoder = load_llava(checkpoint_dir, config, device=device, dtype=dtype)
    return ServedModel(language, encoder, LLAVA_LAYOUT, AutoProcessor.from_pretrained(checkpoint_dir),
                       tower_modules("LlavaForConditionalGeneration", config.to_dict()))


def _load_qwen2vl(checkpoint_dir: Path, config: PretrainedConfig, device: torch.device,
                  dtype: torch.dtype) -> ServedModel:
    language, encoder = load_qwen2vl(checkpoint_dir, config, device=device, dtype=dtype)
    # Not AutoProcessor: Qwen2VLProcessor needs torchvision for its video processor.
    return ServedModel(language, encoder, QWEN2VL_LAYOUT, Qwen2VLPromptProcessor.from_pretrained(checkpoint_dir),
                       tower_modules("Qwen2VLForConditionalGeneration", config.to_dict()))


_LOADERS: dict[str, Callable[[Path, PretrainedConfig, torch.device, torch.dtype], ServedModel]] = {
    "llama": _load_text,
    "mistral": _load_text,
    "qwen2": _load_text,
    "llava": _load_llava,
    "qwen2_vl": _load_qwen2vl,
}


def load_served_model(checkpoint_dir: Path, *, device: torch.device, dtype: torch.dtype) -> ServedModel:
    config = AutoConfig.from_pretrained(checkpoint_dir)
    loader = _LOADERS.get(config.model_type)
    if loader is None:
        raise ValueError(f"{checkpoint_dir}: unsupported model_type {config.model_type!r} ({', '.join(_LOADERS)})")
    return loader(checkpoint_dir, config, device, dtype)
