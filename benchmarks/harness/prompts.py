"""The suites' prompts: random ones of an exact token count over the bench tokenizer's padding tokens
(no prefix-cache hits between two), and readable ones of about a token count whose first KV block
holds their number (for any tokenizer: the live system's).

    requests = Requests(bench_tokenizer(vocab_size))
    request = requests.make(adapter_ref, prompt_tokens=512, max_tokens=1)
    text = word_prompt(7, 128)   # "request 7: adapter and streams each token ..."
"""

from __future__ import annotations

import itertools

import torch
from transformers import PreTrainedTokenizerFast

from benchmarks.harness.serving import BENCH_TOKEN_PREFIX
from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.sequence import SamplingParams

PROMPT_WORDS = "the engine schedules every request on its adapter and streams each token as it comes".split()


def fillers(tokenizer: PreTrainedTokenizerFast) -> list[str]:
    """The bench tokenizer's padding tokens (serving.bench_tokenizer): one token each."""
    return [token for token in tokenizer.get_added_vocab() if token.startswith(BENCH_TOKEN_PREFIX)]


def exact_prompt(tokenizer: PreTrainedTokenizerFast, fillers: list[str], generator: torch.Generator,
                 tokens: int) -> str:
    """A random prompt of exactly `tokens` tokens: BOS, then `fillers` drawn at random."""
    picks = torch.randint(0, len(fillers), (tokens - 1,), generator=generator).tolist()
    text = "".join(fillers[i] for i in picks)
    assert len(tokenizer(text)["input_ids"]) == tokens, text[:80]
    return text


class Requests:
    """Requests with random prompts of exact token counts (no prefix-cache hits between them)."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self._tokenizer = tokenizer
        self._fillers = fillers(tokenizer)
        self._gen = torch.Generator().manual_seed(0)
        self._ids = itertools.count()

    def make(self, adapter: AdapterRef | None, prompt_tokens: int, max_tokens: int) -> GenerationRequest:
        prompt = exact_prompt(self._tokenizer, self._fillers, self._gen, prompt_tokens)
        return GenerationRequest(f"cold-{next(self._ids)}", prompt, SamplingParams(max_tokens=max_tokens), adapter)


def word_prompt(k: int, tokens: int) -> str:
    """A prompt of about `tokens` tokens (the demo tokenizer's words run 1-3 tokens) whose first KV block
    holds its number `k`: no prefix-cache hits between two prompts."""
    return f"request {k}: " + " ".join(PROMPT_WORDS[(k + j) % len(PROMPT_WORDS)] for j in range(tokens // 2))
