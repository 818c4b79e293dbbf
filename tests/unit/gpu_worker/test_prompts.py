"""PromptEncoder's bound on tokenization: a prompt past the context is refused from a prefix of its
text, a long prompt that fits is tokenized whole, a normalizer that shrinks text is never refused
by length alone. The reference is the tokenizer itself on the whole text."""

from __future__ import annotations

import random

import pytest
from tokenizers import normalizers
from transformers import AutoProcessor, AutoTokenizer, PreTrainedTokenizerBase

from gpu_worker.prompts import CUT_SLACK, ChatMessage, PromptEncoder, longest_token_chars
from gpu_worker.vision.qwen2vl_processor import Qwen2VLPromptProcessor
from services.common.errors import InvalidArgument

MAX_CONTEXT = 256
MAX_TOKENS = 16
CODE = "def area(width, height):\n    return width * height  # a rectangle's area\n"


@pytest.fixture
def tokenizer(tiny_assets) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_assets.base_dir)


@pytest.fixture
def tokenized(monkeypatch) -> list[int]:
    """The length of every text handed to any tokenizer from now on."""
    lengths: list[int] = []
    call = PreTrainedTokenizerBase.__call__

    def spy(self, text, *args, **kwargs):
        lengths.append(len(text))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", spy)
    return lengths


def test_no_token_stands_for_more_characters_than_the_longest(tokenizer):
    longest = longest_token_chars(tokenizer)
    assert longest == max(len(tokenizer.decode([i])) for i in range(len(tokenizer)))  # byte-level: decoded = text
    rng = random.Random()
    for _ in range(20):
        text = "".join(rng.choice([CODE, "#" * rng.randint(1, 200), " " * rng.randint(1, 80), "é€😀"])
                       for _ in range(rng.randint(1, 30)))
        assert len(text) <= longest * len(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("text", [CODE * 15_000, "#" * 400_000], ids=["code", "longest tokens"])
def test_a_prompt_far_past_the_context_is_refused_from_a_prefix(tokenizer, tokenized, text):
    """Code is refused from the first, short prefix; a run of the vocabulary's longest tokens
    ('#' * 64) needs the last, which bounds every text."""
    encoder = PromptEncoder(tokenizer, MAX_CONTEXT)
    first, last = encoder.prefix_lengths
    assert len(text) > last
    tokenized.clear()
    with pytest.raises(InvalidArgument, match="exceeds the model's context of 256") as err:
        encoder.encode(text, MAX_TOKENS)
    assert max(tokenized) == (first if text.startswith("def") else last), tokenized
    assert err.value.param == "max_tokens"


def test_a_long_prompt_that_fits_is_tokenized_whole(tokenizer, tokenized):
    """Longer than the first prefix, too few tokens to prove anything: the whole text's ids, accepted."""
    encoder = PromptEncoder(tokenizer, MAX_CONTEXT)
    text = "#" * (64 * 200 + random.randint(1, 63))
    assert encoder.prefix_lengths[0] < len(text) <= encoder.prefix_lengths[-1]
    want = tokenizer(text)["input_ids"]
    assert len(want) + MAX_TOKENS <= MAX_CONTEXT
    tokenized.clear()
    assert encoder.encode(text, MAX_TOKENS).token_ids == want
    assert max(tokenized) == len(text)


def test_a_normalizer_that_shrinks_text_is_not_refused_by_its_length(tokenizer):
    tokenizer.backend_tokenizer.normalizer = normalizers.Replace("~", "")
    encoder = PromptEncoder(tokenizer, MAX_CONTEXT)
    text = "area = width * height" + "~" * (encoder.prefix_lengths[-1] + 1000) + " # a rectangle"
    encoded = encoder.encode(text, MAX_TOKENS)
    assert encoded.token_ids == tokenizer(text)["input_ids"] == tokenizer("area = width * height # a rectangle")["input_ids"]


def test_chat_prompts_are_bounded_as_rendered_and_encoded_as_the_template_does(tokenizer, tokenized):
    encoder = PromptEncoder(tokenizer, MAX_CONTEXT)
    chat = (ChatMessage("system", "Answer in Python."), ChatMessage("user", "The area of a rectangle?"))
    want = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in chat],
                                         add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert encoder.encode(chat, MAX_TOKENS).token_ids == list(want)
    tokenized.clear()
    with pytest.raises(InvalidArgument, match="context"):
        encoder.encode((*chat, ChatMessage("user", CODE * 15_000)), MAX_TOKENS)
    assert max(tokenized) == encoder.prefix_lengths[0]


def test_vision_chat_prompts_are_bounded_before_the_processor_tokenizes(llava_assets, qwen2vl_assets, tokenized):
    huge = (ChatMessage("user", CODE * 15_000),)
    for encoder in (PromptEncoder(AutoTokenizer.from_pretrained(llava_assets.base_dir), MAX_CONTEXT,
                                  AutoProcessor.from_pretrained(llava_assets.base_dir)),
                    PromptEncoder(*_qwen2vl(qwen2vl_assets))):
        tokenized.clear()
        with pytest.raises(InvalidArgument, match="context"):
            encoder.encode(huge, MAX_TOKENS)
        assert max(tokenized) == encoder.prefix_lengths[0]


def _qwen2vl(assets) -> tuple[PreTrainedTokenizerBase, int, Qwen2VLPromptProcessor]:
    processor = Qwen2VLPromptProcessor.from_pretrained(assets.base_dir)
    return processor.tokenizer, MAX_CONTEXT, processor


def test_the_slack_covers_a_word_cut_by_the_prefix(tokenizer):
    """A prefix never counts more than CUT_SLACK tokens beyond the whole text's tokens up to its cut."""
    rng = random.Random()
    text = "".join(rng.choice([CODE, "#" * rng.randint(1, 130), "rectangle_area_" * rng.randint(1, 9)])
                   for _ in range(300))
    ids = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    for cut in rng.sample(range(1, len(text)), 50):
        whole_before_cut = sum(1 for start, _ in ids["offset_mapping"] if start < cut)
        assert len(tokenizer(text[:cut], add_special_tokens=False)["input_ids"]) <= whole_before_cut + CUT_SLACK
