"""Incremental detokenization with stop strings, safe to stream.

Two things are held back from the stream until they are settled:
- trailing U+FFFD: a byte-level token may end inside a multi-byte UTF-8 character;
- a suffix of the text that is a prefix of a stop string ("Hel" while waiting for "Hello"):
  if the stop string completes, the text is cut before it and that suffix is never sent.

Decoding works on a short window of tokens (as in vLLM) instead of re-decoding everything:
text of ids[prefix:] minus text of ids[prefix:read] is the new text; the window starts with the
last prompt tokens so tokenizers that drop a leading space decode the first output correctly.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PROMPT_CONTEXT_TOKENS = 5


def ids_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """ids -> text without special tokens and without clean-up. For a fast tokenizer that keeps
    transformers' own decoding, that is the Rust tokenizer's decode called directly: the same text
    for less (transformers' wrapper converts and checks its arguments at every call, and the engine
    decodes twice a token; the figure is in docs/benchmarks/engine.md)."""
    if type(tokenizer)._decode is PreTrainedTokenizerFast._decode:
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], stop: tuple[str, ...]) -> None:
        self._decode = ids_decoder(tokenizer)
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(s for s in stop if s)
        self.text = ""        # output text so far, cut before a stop string once one appears
        self.stopped = False
        self._emitted = 0     # characters of `text` already streamed

    def append(self, token_id: int) -> None:
        assert not self.stopped
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # nothing settled yet (an incomplete UTF-8 character, or a special token)
        self._settle(full[len(prefix):])

    def _flush(self) -> None:
        """At the end nothing stays pending: an incomplete character decodes as U+FFFD, as `decode` renders it."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix):
            self._settle(full[len(prefix):])

    def _settle(self, new_text: str) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._add_text(new_text)

    def take_delta(self, final: bool) -> str:
        """Text not yet streamed; unless `final`, keep back what could start a stop string."""
        if final and not self.stopped:
            self._flush()
        end = len(self.text) if final or self.stopped else len(self.text) - self._stop_prefix_len()
        delta = self.text[self._emitted:end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta

    def _add_text(self, new_text: str) -> None:
        longest = max((len(s) for s in self._stop), default=0)
        search_from = max(0, len(self.text) - longest + 1)
        self.text += new_text
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:k]):
                    best = k
                    break
        return best
