"""Incremental detokenization: stop-string hold-back and no broken UTF-8 in the stream."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from gpu_worker.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets.base_dir)


def _stream(tokenizer, text, stop=()):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id], stop)
    deltas = []
    for token in ids:
        detok.append(token)
        deltas.append(detok.take_delta(final=False))
        if detok.stopped:
            break
    deltas.append(detok.take_delta(final=True))
    return detok, deltas


def test_multibyte_characters_are_never_split(tokenizer):
    text = "naïve café — 日本語 🎉 ok"
    detok, deltas = _stream(tokenizer, text)
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_prefix_is_held_back_then_cut(tokenizer):
    detok, deltas = _stream(tokenizer, "return value END of it", stop=("END",))
    assert detok.stopped and detok.text == "return value "
    assert "".join(deltas) == "return value "


def test_held_back_prefix_is_released_when_it_is_not_a_stop(tokenizer):
    detok, deltas = _stream(tokenizer, "an ENDLESS loop", stop=("END!",))
    assert not detok.stopped and "".join(deltas) == "an ENDLESS loop"


def test_generation_ending_inside_a_character_flushes_like_decode(tokenizer):
    """Cut mid-character at max_tokens: the final text is what `tokenizer.decode` shows (U+FFFD)."""
    ids = tokenizer("café 日本", add_special_tokens=False)["input_ids"]
    for cut in range(1, len(ids) + 1):
        detok = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id], ())
        streamed = ""
        for token in ids[:cut]:
            detok.append(token)
            streamed += detok.take_delta(final=False)
        streamed += detok.take_delta(final=True)
        expected = tokenizer.decode(ids[:cut], skip_special_tokens=True)
        assert detok.text == streamed == expected
