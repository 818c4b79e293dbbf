"""benchmarks/harness/prompts.py: the exact-length prompts the engine suites serve (engine_bench's
end-to-end requests, the cold-start suites'), and the readable prompts of the live suites and
engine_loop_bench."""

from __future__ import annotations

import torch

from benchmarks.harness.prompts import exact_prompt, fillers, word_prompt
from benchmarks.harness.serving import bench_tokenizer
from benchmarks.harness.shapes import LLAMA2_7B

PROMPT_TOKENS = 128  # engine_bench's end-to-end prompts, engine_loop_bench's


def test_exact_prompts_are_exactly_the_prompt_length_and_every_id_decodes():
    vocab = LLAMA2_7B["vocab_size"]
    tokenizer = bench_tokenizer(vocab)
    assert len(tokenizer) == vocab and tokenizer.eos_token_id is None  # requests run to max_tokens
    padding = fillers(tokenizer)
    generator = torch.Generator().manual_seed(0)
    prompts = [exact_prompt(tokenizer, padding, generator, PROMPT_TOKENS) for _ in range(4)]
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    assert all(len(ids) == PROMPT_TOKENS for ids in encoded) and len({tuple(ids) for ids in encoded}) == 4
    assert encoded[0][0] == tokenizer.bos_token_id
    # What a random model of this vocabulary samples decodes to text, the padding ids included.
    sampled = torch.randint(0, vocab, (256,), generator=generator).tolist() + [vocab - 1]
    assert tokenizer.decode(sampled)


def test_word_prompts_differ_and_run_about_the_prompt_length():
    tokenizer = bench_tokenizer()
    prompts = [word_prompt(i, PROMPT_TOKENS) for i in range(4)]
    assert len(set(prompts)) == 4
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    assert all(PROMPT_TOKENS // 2 <= n <= 3 * PROMPT_TOKENS for n in lengths), lengths
