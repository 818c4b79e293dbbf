"""The base-model architectures Tessera serves, by config.json's `architectures[0]`, and which of them take
images and which video. One list for the registry (what may be registered), the gateway (where images may go; it must not
import torch) and the worker (tests/unit/gpu_worker/test_vision_qwen2vl.py checks that each image
architecture loads with an image encoder)."""

from __future__ import annotations

TEXT_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
IMAGE_ARCHITECTURES: tuple[str, ...] = ("LlavaForConditionalGeneration", "Qwen2VLForConditionalGeneration")
SERVED_ARCHITECTURES: tuple[str, ...] = TEXT_ARCHITECTURES + IMAGE_ARCHITECTURES
VIDEO_ARCHITECTURES: tuple[str, ...] = ("Qwen2VLForConditionalGeneration",)  # video natively (temporal patches)


def takes_images(architecture: str) -> bool:
    return architecture in IMAGE_ARCHITECTURES


def takes_video(architecture: str) -> bool:
    return architecture in VIDEO_ARCHITECTURES
