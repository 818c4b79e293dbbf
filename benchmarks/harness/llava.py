"""A LLaVA-1.5-shaped model with random weights behind the engine, for the vision suites: its config, the
served model (our Llama + transformers' CLIP tower and projector) and a word-level processor over its whole
vocabulary."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaProcessor,
                          PreTrainedTokenizerFast)

from benchmarks.harness.shapes import LLAMA2_7B, TARGETS
from gpu_worker.builder import EngineParts, assemble_parts
from gpu_worker.lora.loader import AdapterRef, LoRAWeights
from gpu_worker.models.families import ServedModel
from gpu_worker.models.llama import resolve_dtype
from gpu_worker.models.llava import LlavaImageEncoder
from gpu_worker.models.random_weights import random_llama
from gpu_worker.profile import random_adapters
from services.common.adapter_layout import LLAVA_LAYOUT
from services.common.config import WorkerConfig

BASE_MODEL = "bench-llava"
# LLaVA-1.5's prompt shape, "USER: <image>\n{question} ASSISTANT:"; each <image> becomes one image
# token per feature (the processor expands it), so the question follows the image's tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ 'USER: ' }}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}{% else %}{{ part['text'] + ' ' }}{% endif %}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
SPECIAL_WORDS = ("<unk>", "USER:", "ASSISTANT:")  # ids 0, 1, 2; question words are "w3", "w4", ...


def llava_config(text: LlamaConfig, vision: CLIPVisionConfig, image_token_id: int) -> LlavaConfig:
    """LLaVA-1.5's choices: the second-to-last layer's features, CLS dropped: one token per patch."""
    patches = (vision.image_size // vision.patch_size) ** 2
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                       image_seq_length=patches, vision_feature_layer=-2, vision_feature_select_strategy="default",
                       projector_hidden_act="gelu")



def llava_7b_config() -> LlavaConfig:
    """LLaVA-1.5-7B: CLIP ViT-L/14-336 (576 image tokens per image), Llama-2-7B with LLaVA's vocabulary."""
    return llava_config(LlamaConfig(**{**LLAMA2_7B, "vocab_size": 32064}),
                        CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                         num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768,
                                         hidden_act="quick_gelu", layer_norm_eps=1e-5),
                        image_token_id=32000)


def tiny_llava_config() -> LlavaConfig:
    return llava_config(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=4, vocab_size=512, max_position_embeddings=1024),
                        CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, image_size=56, patch_size=14, projection_dim=32),
                        image_token_id=511)


def random_llava(config: LlavaConfig, device: torch.device, dtype: torch.dtype) -> ServedModel:
    """The served LLaVA (our Llama + transformers' CLIP tower and projector) with random weights."""
    language = random_llama(config.text_config, device=device, dtype=dtype)
    torch.manual_seed(0)
    with torch.device(device):  # transformers' own init, drawn on the device (buffers included)
        encoder = LlavaImageEncoder(config)
    return ServedModel(language, encoder.to(dtype).eval(), LLAVA_LAYOUT)


def llava_parts(config: LlavaConfig, worker: WorkerConfig,
                load: Callable[[AdapterRef], LoRAWeights] | None = None) -> EngineParts:
    """What builder.assemble_engine assembles, with the random model in place of a checkpoint and adapters
    from `load` (default: random rank-`ref.rank` LoRA on TARGETS)."""
    device = torch.device(worker.device)
    dtype = resolve_dtype(worker.dtype, device)
    served = random_llava(config, device, dtype)
    return assemble_parts(served.language_model, worker, Path("/nonexistent"),
                          load=load or random_adapters(config.text_config, TARGETS, device, dtype),
                          image_encoder=served.image_encoder, adapter_layout=served.adapter_layout)


def word_processor(config: LlavaConfig) -> LlavaProcessor:
    """A processor over the model's whole vocabulary: token i is the word "w{i}" (a few are special),
    the image token is "<image>"; no EOS, so nothing stops a request before max_tokens."""
    words = [f"w{i}" for i in range(config.text_config.vocab_size)]
    words[:len(SPECIAL_WORDS)] = SPECIAL_WORDS
    words[config.image_token_index] = "<image>"
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})  # found even between other <image>s
    size = config.vision_config.image_size
    images = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=config.vision_config.patch_size,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=CHAT_TEMPLATE)
    assert processor.image_token_id == config.image_token_index
    return processor
