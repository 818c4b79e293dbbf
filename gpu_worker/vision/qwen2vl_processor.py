"""Qwen2-VL's prompts with images, without transformers' Qwen2VLProcessor.

Qwen2VLProcessor (and AutoProcessor on a Qwen2-VL checkpoint) cannot be built without torchvision: its
video processor needs it. Images need only the image processor (AutoImageProcessor gives the PIL one
where torchvision is missing) and the tokenizer, so this does for images what
Qwen2VLProcessor.apply_chat_template does:

    1. render the chat template with content parts: an image part becomes
       <|vision_start|><|image_pad|><|vision_end|>
    2. preprocess the images: pixel_values [sum of t * h * w, patch dim], image_grid_thw [num_images, 3]
    3. expand the i-th <|image_pad|> to t * h * w / merge_size^2 of them (image i's merged patches)
    4. tokenize, without adding BOS where the rendered text already begins with it

tests/unit/gpu_worker/test_vision_qwen2vl.py checks it against Qwen2VLProcessor built without a video
processor. PromptEncoder uses it as it uses a transformers processor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, BaseImageProcessor, BatchFeature, PreTrainedTokenizerBase

IMAGE_TOKEN = "<|image_pad|>"


class Qwen2VLPromptProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, image_processor: BaseImageProcessor) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        assert self.image_token_id != tokenizer.unk_token_id, f"the tokenizer lacks {IMAGE_TOKEN}"

    @classmethod
    def from_pretrained(cls, directory: Path) -> Qwen2VLPromptProcessor:
        return cls(AutoTokenizer.from_pretrained(directory), AutoImageProcessor.from_pretrained(directory))

    def apply_chat_template(self, conversation: list[dict[str, Any]], *, add_generation_prompt: bool,
                            tokenize: bool, return_dict: bool = False,
                            return_tensors: str | None = None) -> BatchFeature | str:
        """`conversation`: messages whose content is a list of parts, {"type": "text", "text": ...} or
        {"type": "image", "image": <PIL image>}. -> input_ids, attention_mask, mm_token_type_ids [1, n]
        and, with images, pixel_values and image_grid_thw; ValueError where the images do not fit the
        text (as the processor's). tokenize=False: the rendered text, one placeholder per image (as the
        processor's)."""
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        if not tokenize:
            return text
        assert return_dict and return_tensors == "pt", "only what PromptEncoder asks for"
        images: list[Image.Image] = [part["image"] for message in conversation for part in message["content"]
                                     if isinstance(part, dict) and part.get("type") == "image"]
        pieces = text.split(IMAGE_TOKEN)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the prompt has {len(pieces) - 1} {IMAGE_TOKEN} tokens and {len(images)} images")
        vision: dict[str, torch.Tensor] = {}
        if images:
            vision = dict(self.image_processor(images=images, return_tensors="pt"))
            merge = self.image_processor.merge_size ** 2
            counts = [int(grid.prod()) // merge for grid in vision["image_grid_thw"]]
            text = pieces[0] + "".join(IMAGE_TOKEN * n + piece for n, piece in zip(counts, pieces[1:]))
        bos = self.tokenizer.bos_token
        encoded = self.tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)), return_tensors="pt")
        encoded["mm_token_type_ids"] = (encoded["input_ids"] == self.image_token_id).long()
        return BatchFeature({**encoded, **vision})
