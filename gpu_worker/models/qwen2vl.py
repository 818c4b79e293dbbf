"""Qwen2-VL (Qwen2VLForConditionalGeneration): a ViT with a patch merger in front of a Qwen2 language
model that rotates by 3-D positions (M-RoPE, layers/mrope.py).

The language model is our LlamaForCausalLM (paged KV, continuous batching, LoRA), built from the
checkpoint's language-model tensors; its rotary switches to M-RoPE on the config's mrope_section. The
vision side is transformers' own Qwen2VisionTransformerPretrainedModel with the checkpoint's weights,
run once per image: every image at its own resolution, its patches (pixel_values rows) attended within
the image, merge x merge neighbours merged into one feature per image token, as
Qwen2VLModel.get_image_features computes them. Its linears take per-pass LoRA (vision/tower_lora.py): one
pass over images of several adapters, the ViT's rows being patches, the merger's merged patches.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import Qwen2VLConfig
from transformers.initialization import no_init_weights
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from gpu_worker.models.checkpoint import iter_checkpoint, part_selector
from gpu_worker.models.llama import LlamaForCausalLM, build_model
from gpu_worker.vision.images import EncoderImage
from gpu_worker.vision.tower_lora import TowerLoRALinear, adapted, adapter_order, wrap
from services.common.tower_lora import tower_modules

LANGUAGE, VISION = "language", "vision"
# Checkpoint name prefix -> (the part it belongs to, its prefix there); the first match wins. Qwen's
# checkpoints, and transformers 5's save_pretrained, say model.* / lm_head.* / visual.*;
# Qwen2VLForConditionalGeneration's own module tree says model.language_model.* / model.visual.*.
CHECKPOINT_PREFIXES: tuple[tuple[str, str, str], ...] = (
    ("model.language_model.", LANGUAGE, "model."),
    ("model.visual.", VISION, "visual."),
    ("model.", LANGUAGE, "model."),
    ("lm_head.", LANGUAGE, "lm_head."),
    ("visual.", VISION, "visual."),
)


class Qwen2VLImageEncoder(nn.Module):
    def __init__(self, config: Qwen2VLConfig) -> None:
        super().__init__()
        self.visual = Qwen2VisionTransformerPretrainedModel._from_config(config.vision_config)
        self.merge = config.vision_config.spatial_merge_size
        self.lora: dict[str, TowerLoRALinear] = {}  # PEFT module name -> its linear, wrapped once loaded

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [sum of t * h * w, patch dim], grid_thw [num_images, 3] -> [sum of t * h * w /
        merge^2, text hidden]: the images' features one after another."""
        weight = self.visual.merger.mlp[0].weight
        out = self.visual(pixel_values.to(weight.device, weight.dtype), grid_thw=grid_thw.to(weight.device))
        return out.pooler_output

    def encode(self, images: list[EncoderImage]) -> list[torch.Tensor]:
        """ImageEncoder: images of any sizes in one pass (attention stays within each image), in adapter order."""
        order = adapter_order([image.tower for image in images])
        grids = [images[i].grid for i in order]
        assert all(grid is not None for grid in grids), "Qwen2-VL images have patch grids"
        patches = [t * h * w for t, h, w in grids]
        merged = [n // self.merge ** 2 for n in patches]
        with adapted(self.lora, {"patch": patches, "merged": merged}, [images[i].tower for i in order]):
            encoded = self(torch.cat([images[i].pixel_values for i in order]), torch.tensor(grids))
        features: list[torch.Tensor] = [torch.empty(0)] * len(images)
        for i, one in zip(order, encoded.split(merged)):
            features[i] = one
        return features


def load_qwen2vl(checkpoint_dir: Path, config: Qwen2VLConfig, *, device: torch.device,
                 dtype: torch.dtype) -> tuple[LlamaForCausalLM, Qwen2VLImageEncoder]:
    """The language model and the image encoder, each reading only its own tensors."""
    source = str(checkpoint_dir)
    text_config = config.text_config
    # Qwen2-VL keeps tie_word_embeddings on the top-level config; our language model reads its own.
    text_config.tie_word_embeddings = config.tie_word_embeddings
    language_tensors = iter_checkpoint(checkpoint_dir, part_selector(CHECKPOINT_PREFIXES, LANGUAGE, source))
    language = build_model(text_config, language_tensors, source, device=device, dtype=dtype)
    with no_init_weights():  # every weight is overwritten below
        encoder = Qwen2VLImageEncoder(config)
    vision_tensors = iter_checkpoint(checkpoint_dir, part_selector(CHECKPOINT_PREFIXES, VISION, source))
    encoder.load_state_dict(dict(vision_tensors), strict=True)
    # The ViT's linears see [patches, features], the merger's [merged patches, features * merge^2].
    modules = tower_modules("Qwen2VLForConditionalGeneration", config.to_dict())
    encoder.lora = wrap(encoder, {name: "merged" if name.startswith("model.visual.merger.") else "patch"
                                  for name in modules})
    return language, encoder.to(device=device, dtype=dtype).eval()
