"""benchmarks/engine_bench.py's served end-to-end requests, on CPU (the benchmark itself needs CUDA)."""

from __future__ import annotations

import torch

from benchmarks.engine_bench import E2E_PROMPT, LLAMA2_7B, e2e_prompt
from benchmarks.serving import BENCH_TOKEN_PREFIX, bench_tokenizer


def test_e2e_prompts_are_exactly_the_prompt_length_and_every_id_decodes():
    vocab = LLAMA2_7B["vocab_size"]
    tokenizer = bench_tokenizer(vocab)
    assert len(tokenizer) == vocab and tokenizer.eos_token_id is None  # requests run to max_tokens
    fillers = [t for t in tokenizer.get_added_vocab() if t.startswith(BENCH_TOKEN_PREFIX)]
    generator = torch.Generator().manual_seed(0)
    prompts = [e2e_prompt(tokenizer, fillers, generator) for _ in range(4)]
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    assert all(len(ids) == E2E_PROMPT for ids in encoded) and len({tuple(ids) for ids in encoded}) == 4
    assert encoded[0][0] == tokenizer.bos_token_id
    # What a random model of this vocabulary samples decodes to text, the padding ids included.
    sampled = torch.randint(0, vocab, (256,), generator=generator).tolist() + [vocab - 1]
    assert tokenizer.decode(sampled)
