"""Sampling controls, stop strings, max_tokens and abort, through the running engine."""

from __future__ import annotations

import asyncio

import pytest

from gpu_worker.intake import GenerationRequest
from gpu_worker.prompts import ChatMessage
from gpu_worker.sequence import FinishReason, SamplingParams
from services.common.errors import InvalidArgument

from .conftest import collect, idle_stats, run_all, tokens_of

PROMPT = "def main():\n"


def _req(request_id: str, **params) -> GenerationRequest:
    return GenerationRequest(request_id, PROMPT, SamplingParams(**params))


def test_same_seed_same_output_and_top_k_1_is_greedy(engine_factory):
    engine = engine_factory()
    a, b, c, greedy, top1 = run_all(engine, [
        _req("a", temperature=1.0, top_p=0.9, max_tokens=10, seed=7),
        _req("b", temperature=1.0, top_p=0.9, max_tokens=10, seed=7),
        _req("c", temperature=1.0, max_tokens=10, seed=8),
        _req("greedy", max_tokens=10),
        _req("top1", temperature=0.8, top_k=1, max_tokens=10, seed=3),
    ])
    assert tokens_of(a) == tokens_of(b)
    assert tokens_of(a) != tokens_of(c)
    assert tokens_of(top1) == tokens_of(greedy)


def test_max_tokens_and_final_message(engine_factory):
    (outputs,) = run_all(engine_factory(), [_req("len", max_tokens=5)])
    final = outputs[-1]
    assert final.finish_reason is FinishReason.LENGTH
    assert len(tokens_of(outputs)) == final.completion_tokens == 5
    assert "".join(o.text for o in outputs) == final.full_text
    assert final.prompt_tokens > 0


def test_stop_string_truncates_and_is_never_streamed(engine_factory):
    engine = engine_factory()
    (free,) = run_all(engine, [_req("free", max_tokens=12)])
    text = free[-1].full_text
    stop = text[5:8]  # three characters from the middle of the greedy output
    assert len(stop) == 3 and text.find(stop) == 5
    (stopped,) = run_all(engine, [_req("stop", max_tokens=12, stop=("zzzz-never", stop))])
    assert stopped[-1].finish_reason is FinishReason.STOP
    assert stopped[-1].full_text == text[:5]
    assert "".join(o.text for o in stopped) == text[:5]


def test_stop_token_id_ends_right_after_its_first_occurrence(engine_factory):
    engine = engine_factory()
    (free,) = run_all(engine, [_req("free", max_tokens=12)])
    tokens = tokens_of(free)
    assert free[-1].finish_reason is FinishReason.LENGTH and len(tokens) == 12
    stop_id = tokens[3]
    end = tokens.index(stop_id) + 1  # the id may already occur before the 4th token
    unused = next(i for i in range(engine.vocab_size) if i not in tokens)
    (stopped,) = run_all(engine, [_req("stop", max_tokens=12, stop_token_ids=(unused, stop_id))])
    assert tokens_of(stopped) == tokens[:end], "the stop token itself is emitted, nothing after it"
    assert stopped[-1].finish_reason is FinishReason.STOP and stopped[-1].completion_tokens == end


def test_chat_prompt_uses_the_template(engine_factory):
    (outputs,) = run_all(engine_factory(), [GenerationRequest(
        "chat", (ChatMessage("user", "hello"),), SamplingParams(max_tokens=3))])
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert outputs[-1].prompt_tokens > 4  # role tags and turn markers were added


def test_invalid_prompts_are_rejected(engine_factory):
    engine = engine_factory()
    loop = asyncio.new_event_loop()
    with pytest.raises(InvalidArgument, match="empty"):
        engine.submit(GenerationRequest("empty", "", SamplingParams()), loop)
    with pytest.raises(InvalidArgument, match="exceeds the model's context of 256"):
        engine.submit(_req("long", max_tokens=255), loop)
    loop.close()


def test_abort_frees_the_sequence(engine_factory):
    engine = engine_factory(max_num_seqs=1, kv_cache_tokens=512)

    async def main():
        loop = asyncio.get_running_loop()
        handle = engine.submit(_req("victim", max_tokens=200), loop)
        async for _ in handle:
            break  # the client read one delta, then went away
        engine.abort("victim")
        waiting = asyncio.ensure_future(collect(engine, _req("next", max_tokens=3)))
        return await asyncio.wait_for(waiting, timeout=30)

    outputs = asyncio.run(main())
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    stats = idle_stats(engine)
    assert stats.running_requests == 0 and stats.free_kv_tokens == 512  # every block came back
