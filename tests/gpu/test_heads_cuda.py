"""Task heads on a CUDA device: the unit tests' float32 equality with transformers + PEFT and the plain-torch
references (run here on CUDA engines), and bfloat16, the serving default, with CUDA graphs replaying the
generating requests' decode steps while head requests come and go."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gpu_worker.intake import GenerationRequest
from gpu_worker.sequence import SamplingParams
from tests.unit.gpu_worker.conftest import make_engine, tiny_assets  # noqa: F401 (fixture)
from tests.unit.gpu_worker.test_task_heads import (  # noqa: F401 (fixtures and tests run here on CUDA)
    PROMPTS, _answer, _ask, _peft_probs, heads, test_heads_answer_as_peft_and_the_references_beside_generation,
    test_merged_mode_chunked_prompts_and_prefix_hits_answer_the_same, test_merged_steps_answer_as_peft)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16_TOLERANCE = 3e-2  # probabilities from bfloat16 hidden states, against float32 ones


def test_bfloat16_heads_beside_graph_replayed_decodes(tiny_assets, heads):  # noqa: F811
    engine = make_engine(tiny_assets, device="cuda", dtype="bfloat16", kv_cache_tokens=4096)
    try:
        classifier = heads["head-classifier"]
        generating = [GenerationRequest(f"g{i}", PROMPTS[i % 3], SamplingParams(max_tokens=48),
                                        tiny_assets.adapters["demo-r16"]) for i in range(4)]

        async def main():
            streams = [asyncio.ensure_future(_collect(engine, r)) for r in generating]
            await asyncio.sleep(0.05)  # the streams decode (graph replays) when the head requests arrive
            answers = await asyncio.gather(*(_collect(engine, _ask(f"c{i}", PROMPTS[i % 3], classifier))
                                             for i in range(6)))
            return await asyncio.gather(*streams), answers
        streams, answers = asyncio.run(main())
        assert all(len([t for out in s for t in out.token_ids]) == 48 for s in streams)
        assert engine._runner.graphs is not None and engine._runner.graphs._replays > 0
        for i, outputs in enumerate(answers):
            expected = _peft_probs(tiny_assets.base_dir, classifier, PROMPTS[i % 3])
            assert torch.allclose(torch.tensor(_answer(outputs).probs), expected, atol=BF16_TOLERANCE)
    finally:
        engine.stop()


async def _collect(engine, request):
    return [out async for out in engine.submit(request, asyncio.get_running_loop())]
