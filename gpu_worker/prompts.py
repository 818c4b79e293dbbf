"""Prompt tokenization and validation in the worker.

Chat prompts go through the chat template with the assistant turn opened; text prompts are
tokenized as-is with the tokenizer's default special tokens (what `tokenizer(text)` gives). A
vision-language model's chat prompts go through its processor instead (with or without images), as
`processor.apply_chat_template` does: every message in content-part form, images and videos decoded and
preprocessed, each one's placeholder expanded to its tokens. The processor is transformers' own (LLaVA:
images only) or one doing the same for images and videos (Qwen2-VL: vision/qwen2vl_processor.py).

A prompt too long for the context is refused after tokenizing at most a bounded prefix of its text
(text prompts as sent, chat prompts as rendered). No token stands for more than L characters (the
vocabulary's longest), so a text of more than (max_context + 16) * L * 2 characters cannot fit: at
most that many of its first characters are tokenized to prove it (more than max_context + CUT_SLACK
tokens). Ordinary text has far fewer characters per token than L (64 in the demo tokenizer, a run of
"#"), so a prefix of (max_context + 16) * FIRST_TRY_CHARS_PER_TOKEN characters is tried first: a
999,000-character prompt then costs a few milliseconds of tokenization, not a quarter second. A long
text that no prefix proves too long is tokenized whole: a normalizer can shrink text, so the length
in characters alone never refuses a prompt.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from transformers import BatchFeature, PreTrainedTokenizerBase, ProcessorMixin

from gpu_worker.vision.images import PromptImages, decode_image, fixed_size_images, grid_images, image_token_runs
from gpu_worker.vision.qwen2vl_processor import Qwen2VLPromptProcessor
from gpu_worker.vision.video import VideoPart, decode_video
from services.common.errors import InvalidArgument

# A Qwen2-VL processor's output: each kind's pixel values and grids, as Qwen2VLProcessor names them.
GRID_OUTPUTS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}


@dataclass(frozen=True)
class ImagePart:
    data: bytes  # the image file as the request carried it (PNG, JPEG, WebP, ...)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str | tuple[str | ImagePart | VideoPart, ...]  # text, or text, images and videos in order


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
    if any(isinstance(part, VideoPart) for part in message.content):
        raise InvalidArgument("this model does not take video", param="messages")
    return "".join(message.content)


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """L: the most characters of text one token id stands for, over the whole vocabulary (added and
    special tokens included: a prompt's text may spell them). Each id decoded alone, or its raw piece
    where that is longer: decoding alone drops a leading "▁" (SentencePiece), and a byte-level piece
    ("Ġthe") or a byte-fallback one ("<0xE3>") has at least one character per byte it stands for."""
    ids = list(range(len(tokenizer)))
    decoded = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    return max(max(len(text), len(piece or "")) for text, piece in zip(decoded, pieces))


# Tokens a prefix may count beyond the whole text's: its cut splits a word into more tokens than
# the word has whole (the prefix is tokenized without special tokens, so they need none).
CUT_SLACK = 8
# More than ordinary text of any script has per token (English ~4.5 with large vocabularies, code ~3).
FIRST_TRY_CHARS_PER_TOKEN = 8


class PromptEncoder:
    """`processor`: a vision-language model's processor (image processor, tokenizer, chat template)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_context: int,
                 processor: ProcessorMixin | Qwen2VLPromptProcessor | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.processor = processor
        # The prefixes tried on a long text, shortest first (module docstring); the last proves any
        # text longer than it too long, unless a normalizer shrinks it.
        bound = (max_context + 16) * longest_token_chars(tokenizer) * 2
        self.prefix_lengths = tuple(sorted({min((max_context + 16) * FIRST_TRY_CHARS_PER_TOKEN, bound), bound}))

    def encode(self, prompt: Prompt, max_tokens: int) -> EncodedPrompt:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument("prompt is empty", param="prompt")
            self._refuse_past_context(prompt, max_tokens)
            encoded = EncodedPrompt(self.tokenizer(prompt)["input_ids"])
        elif not prompt:
            raise InvalidArgument("chat prompt has no messages", param="messages")
        elif self.processor is None:
            messages = [{"role": m.role, "content": _text_of(m)} for m in prompt]
            # Rendered, then tokenized as apply_chat_template(tokenize=True) does: the template holds its specials.
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            self._refuse_past_context(text, max_tokens)
            encoded = EncodedPrompt(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            encoded = self._encode_multimodal(prompt, max_tokens)
        ids = encoded.token_ids
        if not ids:
            raise InvalidArgument("prompt is empty after tokenization", param="prompt")
        if len(ids) + max_tokens > self.max_context:
            raise InvalidArgument(
                f"prompt has {len(ids)} tokens; with max_tokens {max_tokens} it exceeds the model's "
                f"context of {self.max_context}", param="max_tokens")
        return encoded

    def _refuse_past_context(self, text: str, max_tokens: int) -> None:
        """InvalidArgument if a prefix of `text` alone holds more tokens than the context: the
        tokenizer then never sees the rest. Returns when `text` is to be tokenized whole."""
        for chars in self.prefix_lengths:
            if len(text) <= chars:
                return  # tokenizing it whole costs no more than this prefix would
            counted = len(self.tokenizer(text[:chars], add_special_tokens=False)["input_ids"])
            if counted > self.max_context + CUT_SLACK:
                raise InvalidArgument(
                    f"prompt has more than {counted - CUT_SLACK} tokens (its first {chars} characters hold "
                    f"{counted}); with max_tokens {max_tokens} it exceeds the model's context of {self.max_context}",
                    param="max_tokens")

    def _encode_multimodal(self, prompt: tuple[ChatMessage, ...], max_tokens: int) -> EncodedPrompt:
        messages, kinds, digests = [], [], []  # kinds, digests: of each image and video, in prompt order
        for message in prompt:
            parts = (message.content,) if isinstance(message.content, str) else message.content
            content = []
            for part in parts:
                if isinstance(part, ImagePart):
                    image = decode_image(part.data, kinds.count("image"))
                    digests.append(hashlib.sha256(part.data).hexdigest())  # the image cache's and KV prefix's key
                    kinds.append("image")
                    content.append({"type": "image", "image": image})
                elif isinstance(part, VideoPart):
                    if getattr(self.processor, "video_token_id", None) is None:
                        raise InvalidArgument("this model does not take video", param="messages")
                    frames = decode_video(part, kinds.count("video"))
                    digests.append(_frames_digest(frames))  # the grid joins it below
                    kinds.append("video")
                    content.append({"type": "video", "video": frames})
                else:
                    content.append({"type": "text", "text": part})
            messages.append({"role": message.role, "content": content})
        # Each image's placeholder is one token of the rendered text here; its expansion only adds tokens.
        self._refuse_past_context(self.processor.apply_chat_template(messages, add_generation_prompt=True,
                                                                     tokenize=False), max_tokens)
        try:
            out = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, return_tensors="pt")
        except ValueError as exc:  # e.g. the text itself holds the image placeholder: counts differ
            raise InvalidArgument(f"the prompt's images do not fit its text: {exc}", param="messages") from exc
        ids = out["input_ids"][0].tolist()
        if not kinds:
            return EncodedPrompt(ids)
        return EncodedPrompt(ids, self._prompt_images(ids, out, kinds, digests))

    def _prompt_images(self, ids: list[int], out: BatchFeature, kinds: list[str], digests: list[str]) -> PromptImages:
        if "pixel_values" in out and "image_grid_thw" not in out:  # LLaVA: images of one size
            runs = image_token_runs(ids, {self.processor.image_token_id})
            return fixed_size_images(out["pixel_values"], runs, tuple(digests))
        # Qwen2-VL: each image and video at its own resolution, positions by M-RoPE
        runs = image_token_runs(ids, {self.processor.image_token_id, self.processor.video_token_id})
        per_kind = {}
        for kind, (pixels_key, grid_key) in GRID_OUTPUTS.items():
            if grid_key in out:
                grids = [(t, h, w) for t, h, w in out[grid_key].tolist()]
                per_kind[kind] = iter(zip(out[pixels_key].split([t * h * w for t, h, w in grids]), grids))
        visuals = [next(per_kind[kind]) for kind in kinds]
        # A video's features depend on its frames and its grid: both key the caches.
        digests = [hashlib.sha256(f"{digest}:{grid}".encode()).hexdigest() if kind == "video" else digest
                   for kind, digest, (_, grid) in zip(kinds, digests, visuals)]
        merge = self.processor.image_processor.merge_size
        return grid_images(len(ids), visuals, runs, tuple(digests), merge)


def _frames_digest(frames: torch.Tensor) -> str:
    """sha256 of decoded frames uint8 [n, height, width, 3]: their shape and pixels."""
    digest = hashlib.sha256(str(tuple(frames.shape)).encode())
    digest.update(frames.contiguous().numpy().tobytes())
    return digest.hexdigest()
