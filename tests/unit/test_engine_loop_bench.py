"""benchmarks/engine_loop_bench.py on CPU (tiny Llama): the bare step and the engine loop on one model."""

from __future__ import annotations

import torch

from benchmarks import engine_loop_bench as bench
from benchmarks.serving import bench_tokenizer


def test_rows_time_every_decode_step_of_the_whole_batch():
    new_tokens = 12
    rows, churn = bench.run(torch.device("cpu"), [1, 3], list(bench.CASES), new_tokens, steps=3)
    assert [(row.batch, row.case) for row in rows] == [(b, c) for b in (1, 3) for c in bench.CASES]
    for row in rows:
        assert row.bare_ms > 0 and row.loop_ms > 0 and row.sync_ms > 0
        # A request decodes new_tokens - 1 steps after the prefill step that samples its first token (no EOS
        # stops it early). With every request admitted in one step, all of those steps but the last pair, less
        # the two settling ones, are timed; each later admission step loses one.
        most = new_tokens - 1 - 1 - 2
        for timed in (row.loop_steps, row.sync_steps):
            assert most - (row.batch - 1) <= timed <= most, row
    # Churn: every case, through both engines, 4 x 3 requests of the seeded lengths, all of their tokens.
    lengths = bench.churn_lengths(12, new_tokens)
    assert [(c.case, c.requests, c.running, c.tokens) for c in churn] == \
        [(case, 12, 3, sum(lengths)) for case in bench.CASES]
    assert all(c.async_tokens_per_s > 0 and c.sync_tokens_per_s > 0 for c in churn)
    assert min(lengths) >= new_tokens // 3 and max(lengths) <= 5 * new_tokens // 3 and len(set(lengths)) > 1


def test_prompts_differ_and_run_about_the_prompt_length():
    tokenizer = bench_tokenizer()
    prompts = [bench.prompt_text(i) for i in range(4)]
    assert len(set(prompts)) == 4
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    assert all(bench.PROMPT_TOKENS // 2 <= n <= 3 * bench.PROMPT_TOKENS for n in lengths), lengths
