"""Prompt tokenization and validation in the worker.

Chat prompts go through the tokenizer's chat template with the assistant turn opened; text
prompts are tokenized as-is with the tokenizer's default special tokens (what `tokenizer(text)`
gives).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from services.errors import InvalidArgument


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


Prompt = str | tuple[ChatMessage, ...]


class PromptEncoder:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_context: int) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context

    def encode(self, prompt: Prompt, max_tokens: int) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument("prompt is empty", param="prompt")
            ids = self.tokenizer(prompt)["input_ids"]
        else:
            if not prompt:
                raise InvalidArgument("chat prompt has no messages", param="messages")
            messages = [{"role": m.role, "content": m.content} for m in prompt]
            ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"])
        if not ids:
            raise InvalidArgument("prompt is empty after tokenization", param="prompt")
        if len(ids) + max_tokens > self.max_context:
            raise InvalidArgument(
                f"prompt has {len(ids)} tokens; with max_tokens {max_tokens} it exceeds the model's "
                f"context of {self.max_context}", param="max_tokens")
        return ids
