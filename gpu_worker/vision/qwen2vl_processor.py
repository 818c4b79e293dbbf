"""Qwen2-VL's prompts with images and videos, without transformers' Qwen2VLProcessor.

Qwen2VLProcessor (and AutoProcessor on a Qwen2-VL checkpoint) cannot be built without torchvision: its
video processor needs it. Images need only the image processor (AutoImageProcessor gives the PIL one
where torchvision is missing), videos the same steps in torch (vision/qwen2vl_video.py), so this does
what Qwen2VLProcessor.apply_chat_template does:

    1. render the chat template with content parts: an image part becomes
       <|vision_start|><|image_pad|><|vision_end|>, a video part <|vision_start|><|video_pad|><|vision_end|>
    2. preprocess the images: pixel_values [sum of t * h * w, patch dim], image_grid_thw [num_images, 3];
       and the videos: pixel_values_videos, video_grid_thw [num_videos, 3]
    3. expand the i-th <|image_pad|> (<|video_pad|>) to t * h * w / merge_size^2 of them (its merged patches)
    4. tokenize, without adding BOS where the rendered text already begins with it

tests/unit/gpu_worker/test_vision_qwen2vl.py checks it against Qwen2VLProcessor built without a video
processor, tests/unit/gpu_worker/test_vision_video.py the videos against transformers' own algorithm.
PromptEncoder uses it as it uses a transformers processor.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, BaseImageProcessor, BatchFeature, PreTrainedTokenizerBase

from gpu_worker.vision.qwen2vl_video import VideoProcessing

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
PLACEHOLDERS = re.compile(f"({re.escape(IMAGE_TOKEN)}|{re.escape(VIDEO_TOKEN)})")
VIDEO_TOKEN_TYPE = 2  # mm_token_type_ids: text 0, image 1, video 2 (what get_rope_index groups by)


class Qwen2VLPromptProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, image_processor: BaseImageProcessor,
                 video_processing: VideoProcessing) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.video_processing = video_processing
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        self.video_token_id = tokenizer.convert_tokens_to_ids(VIDEO_TOKEN)
        for token, token_id in ((IMAGE_TOKEN, self.image_token_id), (VIDEO_TOKEN, self.video_token_id)):
            assert token_id != tokenizer.unk_token_id, f"the tokenizer lacks {token}"

    @classmethod
    def from_pretrained(cls, directory: Path) -> Qwen2VLPromptProcessor:
        return cls(AutoTokenizer.from_pretrained(directory), AutoImageProcessor.from_pretrained(directory),
                   VideoProcessing.from_pretrained(directory))

    def apply_chat_template(self, conversation: list[dict[str, Any]], *, add_generation_prompt: bool,
                            tokenize: bool, return_dict: bool = False,
                            return_tensors: str | None = None) -> BatchFeature | str:
        """`conversation`: messages whose content is a list of parts, {"type": "text", "text": ...},
        {"type": "image", "image": <PIL image>} or {"type": "video", "video": <uint8 [frames, h, w, 3]>}.
        -> input_ids, attention_mask, mm_token_type_ids [1, n] and, with images, pixel_values and
        image_grid_thw, with videos pixel_values_videos and video_grid_thw; ValueError where the images or
        videos do not fit the text (as the processor's). tokenize=False: the rendered text, one placeholder
        per image or video (as the processor's)."""
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        if not tokenize:
            return text
        assert return_dict and return_tensors == "pt", "only what PromptEncoder asks for"
        images: list[Image.Image] = _parts(conversation, "image")
        videos: list[torch.Tensor] = _parts(conversation, "video")
        pieces = PLACEHOLDERS.split(text)  # text, placeholder, text, ..., text
        placeholders = pieces[1::2]
        for token, items, kind in ((IMAGE_TOKEN, images, "images"), (VIDEO_TOKEN, videos, "videos")):
            if placeholders.count(token) != len(items):
                raise ValueError(f"the prompt has {placeholders.count(token)} {token} tokens and {len(items)} {kind}")
        vision: dict[str, torch.Tensor] = {}
        if images:
            vision = dict(self.image_processor(images=images, return_tensors="pt"))
        if videos:
            pixels, grids = zip(*map(self.video_processing, videos))
            vision |= {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids)}
        counts = {token: iter(int(grid.prod()) // self.image_processor.merge_size ** 2 for grid in vision[key])
                  for token, key in ((IMAGE_TOKEN, "image_grid_thw"), (VIDEO_TOKEN, "video_grid_thw"))
                  if key in vision}
        text = "".join(piece * next(counts[piece]) if i % 2 else piece for i, piece in enumerate(pieces))
        bos = self.tokenizer.bos_token
        encoded = self.tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)), return_tensors="pt")
        ids = encoded["input_ids"]
        encoded["mm_token_type_ids"] = ((ids == self.image_token_id).long()
                                        + VIDEO_TOKEN_TYPE * (ids == self.video_token_id))
        return BatchFeature({**encoded, **vision})


def _parts(conversation: list[dict[str, Any]], kind: str) -> list[Any]:
    """The `kind` ("image", "video") parts' payloads, in prompt order."""
    return [part[kind] for message in conversation for part in message["content"]
            if isinstance(part, dict) and part.get("type") == kind]
