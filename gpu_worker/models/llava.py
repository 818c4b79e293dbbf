"""LLaVA-1.5 (LlavaForConditionalGeneration): a CLIP vision tower and a projector in front of a Llama.

The language model is our LlamaForCausalLM (paged KV, continuous batching, LoRA), built from the
checkpoint's language-model tensors. The vision side is transformers' own modules (the CLIP tower,
LlavaMultiModalProjector) with the checkpoint's weights, run once per prompt: the hidden states of
vision_feature_layer (the CLS position dropped under the "default" strategy) go through the
projector, one feature per image token, as LlavaModel.get_image_features computes them. Its linears take
per-pass LoRA (vision/tower_lora.py): one pass over images of several adapters, a row per image.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel, LlavaConfig
from transformers.initialization import no_init_weights
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from gpu_worker.models.checkpoint import iter_checkpoint, part_selector
from gpu_worker.models.llama import LlamaForCausalLM, build_model
from gpu_worker.vision.images import EncoderImage
from gpu_worker.vision.tower_lora import TowerLoRALinear, adapted, adapter_order, wrap
from services.common.tower_lora import tower_modules

LANGUAGE, VISION = "language", "vision"
# Checkpoint name prefix -> (the part it belongs to, its prefix there); the first match wins.
# transformers 5 saves, as llava-hf ships, language_model.model.* / language_model.lm_head.* /
# vision_tower.*; LlavaForConditionalGeneration's own module tree says model.language_model.* /
# lm_head.* / model.vision_tower.*; older CLIP towers nest their weights under vision_model.
CHECKPOINT_PREFIXES: tuple[tuple[str, str, str], ...] = (
    ("language_model.model.", LANGUAGE, "model."),
    ("language_model.lm_head.", LANGUAGE, "lm_head."),
    ("model.language_model.", LANGUAGE, "model."),
    ("lm_head.", LANGUAGE, "lm_head."),
    ("vision_tower.vision_model.", VISION, "vision_tower."),
    ("vision_tower.", VISION, "vision_tower."),
    ("model.vision_tower.vision_model.", VISION, "vision_tower."),
    ("model.vision_tower.", VISION, "vision_tower."),
    ("multi_modal_projector.", VISION, "multi_modal_projector."),
    ("model.multi_modal_projector.", VISION, "multi_modal_projector."),
)


class LlavaImageEncoder(nn.Module):
    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        layer = config.vision_feature_layer
        self.feature_layers = [layer] if isinstance(layer, int) else list(layer)
        self.drop_cls = config.vision_feature_select_strategy == "default"
        self.lora: dict[str, TowerLoRALinear] = {}  # PEFT module name -> its linear, wrapped once loaded

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[num_images, channels, height, width] -> [num_images, tokens_per_image, text hidden]."""
        weight = self.multi_modal_projector.linear_1.weight
        pixel_values = pixel_values.to(weight.device, weight.dtype)
        # (embeddings, layer 1, ..., layer L), each [num_images, 1 + patches, vision hidden]; CLS first
        hidden_states = self.vision_tower(pixel_values, output_hidden_states=True).hidden_states
        selected = [hidden_states[i][:, 1:] if self.drop_cls else hidden_states[i] for i in self.feature_layers]
        return self.multi_modal_projector(torch.cat(selected, dim=-1))

    def encode(self, images: list[EncoderImage]) -> list[torch.Tensor]:
        """ImageEncoder: the images of one size go through the tower as one batch, in adapter order."""
        by_size: dict[tuple[int, ...], list[int]] = {}
        for i in adapter_order([image.tower for image in images]):
            by_size.setdefault(tuple(images[i].pixel_values.shape), []).append(i)
        features: list[torch.Tensor] = [torch.empty(0)] * len(images)
        for indices in by_size.values():
            with adapted(self.lora, {"image": [1] * len(indices)}, [images[i].tower for i in indices]):
                encoded = self(torch.stack([images[i].pixel_values for i in indices]))
            for i, one in zip(indices, encoded.unbind(0)):
                features[i] = one
        return features


def load_llava(checkpoint_dir: Path, config: LlavaConfig, *, device: torch.device,
               dtype: torch.dtype) -> tuple[LlamaForCausalLM, LlavaImageEncoder]:
    """The language model and the image encoder, each reading only its own tensors."""
    source = str(checkpoint_dir)
    language_tensors = iter_checkpoint(checkpoint_dir, part_selector(CHECKPOINT_PREFIXES, LANGUAGE, source))
    language = build_model(config.text_config, language_tensors, source, device=device, dtype=dtype)
    with no_init_weights():  # every weight is overwritten below
        encoder = LlavaImageEncoder(config)
    vision_tensors = iter_checkpoint(checkpoint_dir, part_selector(CHECKPOINT_PREFIXES, VISION, source))
    encoder.load_state_dict(dict(vision_tensors), strict=True)
    # Every adapted linear sees [images, tokens, features]: a row is an image.
    encoder.lora = wrap(encoder, dict.fromkeys(tower_modules("LlavaForConditionalGeneration", config.to_dict()),
                                               "image"))
    return language, encoder.to(device=device, dtype=dtype).eval()
