"""OpenAI's `choices[i].logprobs` objects, built from the stream's TokenLogprob messages.

Chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
Completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}

A token's text is the worker's decoding of that id alone; `bytes` are its UTF-8 bytes (a
byte-level token that ends inside a character decodes to U+FFFD, so its bytes are U+FFFD's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tessera.v1 import common_pb2


def _candidate(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(entries: Iterable[common_pb2.TokenLogprob]) -> dict[str, Any]:
    return {"content": [{**_candidate(e.token, e.logprob),
                         "top_logprobs": [_candidate(t.token, t.logprob) for t in e.top_logprobs]}
                        for e in entries]}


def completion_logprobs(entries: Sequence[common_pb2.TokenLogprob], text_offsets: Sequence[int]) -> dict[str, Any]:
    """text_offsets: where each token's text starts in the completion's text (one per entry)."""
    assert len(entries) == len(text_offsets)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [_top_by_text(e) for e in entries],
            "text_offset": list(text_offsets)}


def _top_by_text(entry: common_pb2.TokenLogprob) -> dict[str, float]:
    # Keyed by text, as OpenAI's legacy object is: two ids with the same text (e.g. both U+FFFD)
    # keep the likelier one, which comes first.
    top: dict[str, float] = {}
    for t in entry.top_logprobs:
        top.setdefault(t.token, t.logprob)
    return top
