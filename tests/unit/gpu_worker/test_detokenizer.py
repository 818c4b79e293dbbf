"""Incremental detokenization: stop-string hold-back and no broken UTF-8 in the stream."""

from __future__ import annotations

import copy
import random

import pytest
from transformers import AutoTokenizer

from gpu_worker.detokenizer import IncrementalDetokenizer, ids_decoder


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


def test_direct_decoding_gives_transformers_text(tokenizer):
    """The Rust tokenizer called directly decodes as tokenizer.decode does (special tokens skipped, no
    clean-up), on random ids that include special tokens and bytes of split characters."""
    rng = random.Random(0)
    decode = ids_decoder(tokenizer)
    ids = list(range(len(tokenizer)))
    for _ in range(200):
        sample = [rng.choice(ids) for _ in range(rng.randint(1, 12))]
        assert decode(sample) == tokenizer.decode(sample, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_tokenizer_with_its_own_decoding_keeps_it(tokenizer):
    class Shouting(type(tokenizer)):
        def _decode(self, token_ids, **kwargs) -> str:
            return super()._decode(token_ids, **kwargs).upper()

    shouting = copy.copy(tokenizer)
    shouting.__class__ = Shouting
    ids = tokenizer("quiet words", add_special_tokens=False)["input_ids"]
    assert ids_decoder(shouting)(ids) == "QUIET WORDS"
