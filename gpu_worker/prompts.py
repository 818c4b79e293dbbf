"""Prompt tokenization and validation in the worker.

Chat prompts go through the chat template with the assistant turn opened; text prompts are
tokenized as-is with the tokenizer's default special tokens (what `tokenizer(text)` gives). A
vision-language model's chat prompts go through its processor instead (with or without images), as
`processor.apply_chat_template` does: every message in content-part form, images decoded and
preprocessed, each image's placeholder expanded to its image tokens. The processor is transformers'
own (LLaVA) or one doing the same for images (Qwen2-VL: vision/qwen2vl_processor.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from transformers import BatchFeature, PreTrainedTokenizerBase, ProcessorMixin

from gpu_worker.vision.images import PromptImages, decode_image, fixed_size_images, grid_images, image_token_runs
from gpu_worker.vision.qwen2vl_processor import Qwen2VLPromptProcessor
from services.common.errors import InvalidArgument


@dataclass(frozen=True)
class ImagePart:
    data: bytes  # the image file as the request carried it (PNG, JPEG, WebP, ...)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str | tuple[str | ImagePart, ...]  # text, or text and images in the order they appear


Prompt = str | tuple[ChatMessage, ...]


@dataclass(frozen=True)
class EncodedPrompt:
    token_ids: list[int]
    images: PromptImages | None = None


def _text_of(message: ChatMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    if any(isinstance(part, ImagePart) for part in message.content):
        raise InvalidArgument("this model does not take images", param="messages")
    return "".join(message.content)


class PromptEncoder:
    """`processor`: a vision-language model's processor (image processor, tokenizer, chat template)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_context: int,
                 processor: ProcessorMixin | Qwen2VLPromptProcessor | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.processor = processor

    def encode(self, prompt: Prompt, max_tokens: int) -> EncodedPrompt:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument("prompt is empty", param="prompt")
            encoded = EncodedPrompt(self.tokenizer(prompt)["input_ids"])
        elif not prompt:
            raise InvalidArgument("chat prompt has no messages", param="messages")
        elif self.processor is None:
            messages = [{"role": m.role, "content": _text_of(m)} for m in prompt]
            encoded = EncodedPrompt(list(self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]))
        else:
            encoded = self._encode_multimodal(prompt)
        ids = encoded.token_ids
        if not ids:
            raise InvalidArgument("prompt is empty after tokenization", param="prompt")
        if len(ids) + max_tokens > self.max_context:
            raise InvalidArgument(
                f"prompt has {len(ids)} tokens; with max_tokens {max_tokens} it exceeds the model's "
                f"context of {self.max_context}", param="max_tokens")
        return encoded

    def _encode_multimodal(self, prompt: tuple[ChatMessage, ...]) -> EncodedPrompt:
        messages, images, digests = [], [], []
        for message in prompt:
            parts = (message.content,) if isinstance(message.content, str) else message.content
            content = []
            for part in parts:
                if isinstance(part, ImagePart):
                    images.append(decode_image(part.data, len(images)))
                    digests.append(hashlib.sha256(part.data).hexdigest())  # the image cache's and KV prefix's key
                    content.append({"type": "image", "image": images[-1]})
                else:
                    content.append({"type": "text", "text": part})
            messages.append({"role": message.role, "content": content})
        try:
            out = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, return_tensors="pt")
        except ValueError as exc:  # e.g. the text itself holds the image placeholder: counts differ
            raise InvalidArgument(f"the prompt's images do not fit its text: {exc}", param="messages") from exc
        ids = out["input_ids"][0].tolist()
        if not images:
            return EncodedPrompt(ids)
        return EncodedPrompt(ids, self._prompt_images(ids, out, tuple(digests)))

    def _prompt_images(self, ids: list[int], out: BatchFeature, digests: tuple[str, ...]) -> PromptImages:
        runs = image_token_runs(ids, self.processor.image_token_id)
        if "image_grid_thw" in out:  # each image at its own resolution (Qwen2-VL), positions by M-RoPE
            merge = self.processor.image_processor.merge_size
            return grid_images(len(ids), out["pixel_values"], out["image_grid_thw"], runs, digests, merge)
        return fixed_size_images(out["pixel_values"], runs, digests)
