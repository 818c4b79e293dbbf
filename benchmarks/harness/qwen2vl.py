"""A Qwen2-VL-shaped model with random weights behind the engine, for the video suite: its config (7B's, or a
tiny one), the served model (our Qwen2 language model with M-RoPE + transformers' ViT and patch merger) and a
word-level prompt processor over its whole vocabulary ("w{i}" is token i; the vision tokens are its last four)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLImageProcessorPil

from gpu_worker.builder import EngineParts, assemble_parts
from gpu_worker.lora.loader import AdapterRef, LoRAWeights
from gpu_worker.models.families import ServedModel
from gpu_worker.models.llama import resolve_dtype
from gpu_worker.models.qwen2vl import Qwen2VLImageEncoder
from gpu_worker.models.random_weights import random_llama
from gpu_worker.vision.qwen2vl_processor import Qwen2VLPromptProcessor
from gpu_worker.vision.qwen2vl_video import VideoProcessing
from services.common.adapter_layout import QWEN2VL_LAYOUT
from services.common.config import WorkerConfig

BASE_MODEL = "bench-qwen2vl"
SPECIAL_WORDS = ("<unk>", "USER:", "ASSISTANT:")  # ids 0, 1, 2
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ 'USER: ' }}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|> ' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|> ' }}"
    "{% else %}{{ part['text'] + ' ' }}{% endif %}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def qwen2vl_config(text: dict, vision: dict) -> Qwen2VLConfig:
    vocab = text["vocab_size"]
    ids = dict(zip(VISION_TOKENS, range(vocab - len(VISION_TOKENS), vocab)))
    return Qwen2VLConfig(text_config=text, vision_config={**vision, "hidden_size": text["hidden_size"]},
                         image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                         vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                         tie_word_embeddings=False)


def qwen2vl_7b_config() -> Qwen2VLConfig:
    """Qwen2-VL-7B-Instruct's shapes: a 675M-parameter ViT (32 blocks of 1280, 14 px patches, 2 x 2 merged, 2
    frames a temporal patch) before Qwen2-7B (28 layers of 3584, GQA 28 / 4, M-RoPE sections 16, 24, 24)."""
    text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    vision = dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    return qwen2vl_config(text, vision)


def tiny_qwen2vl_config() -> Qwen2VLConfig:
    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, embed_dim=32, num_heads=4, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    return qwen2vl_config(text, vision)


def random_qwen2vl(config: Qwen2VLConfig, device: torch.device, dtype: torch.dtype) -> ServedModel:
    """The served Qwen2-VL (our language model + transformers' ViT and merger) with random weights."""
    config.text_config.tie_word_embeddings = config.tie_word_embeddings  # as gpu_worker/models/qwen2vl.py reads it
    language = random_llama(config.text_config, device=device, dtype=dtype)
    torch.manual_seed(0)
    with torch.device(device):  # transformers' own init, drawn on the device
        encoder = Qwen2VLImageEncoder(config)
    return ServedModel(language, encoder.to(dtype).eval(), QWEN2VL_LAYOUT)


def word_processor(config: Qwen2VLConfig) -> Qwen2VLPromptProcessor:
    """A processor over the model's whole vocabulary, without EOS; images and videos at Qwen2-VL's own
    resolution rules (up to 768 merged patches a frame)."""
    vocab = config.text_config.vocab_size
    words = [f"w{i}" for i in range(vocab - len(VISION_TOKENS))]
    words[:len(SPECIAL_WORDS)] = SPECIAL_WORDS
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate([*words, *VISION_TOKENS])},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})  # found between each other
    tokenizer.chat_template = CHAT_TEMPLATE
    patch, merge = config.vision_config.patch_size, config.vision_config.spatial_merge_size
    images = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=merge)
    return Qwen2VLPromptProcessor(tokenizer, images, VideoProcessing(patch_size=patch, merge_size=merge))


def qwen2vl_parts(config: Qwen2VLConfig, worker: WorkerConfig,
                  load: Callable[[AdapterRef], LoRAWeights]) -> EngineParts:
    """What builder.assemble_engine assembles, with the random model in place of a checkpoint."""
    device = torch.device(worker.device)
    served = random_qwen2vl(config, device, resolve_dtype(worker.dtype, device))
    return assemble_parts(served.language_model, worker, Path("/nonexistent"), load=load,
                          image_encoder=served.image_encoder, adapter_layout=served.adapter_layout)
