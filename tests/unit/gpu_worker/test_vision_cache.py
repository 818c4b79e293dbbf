"""The image-embedding cache and KV prefix caching over image tokens (LLaVA): a repeated image is not
encoded again; a prefix holding an image is shared only with requests showing the same image; the
greedy tokens equal a run without caches and transformers + PEFT's."""

from __future__ import annotations

import asyncio
import functools

import pytest
from prometheus_client import CollectorRegistry
from transformers import AutoProcessor, AutoTokenizer

from gpu_worker.engine import Engine
from gpu_worker.intake import GenerationRequest
from gpu_worker.metrics import CacheMetrics
from gpu_worker.prompts import ChatMessage, ImagePart, Prompt, PromptEncoder
from gpu_worker.sequence import SamplingParams
from services.common.config import WorkerConfig
from tessera.v1 import common_pb2, worker_pb2
from tests.reference import VisionReferenceModels, assert_same_greedy

from .conftest import idle_stats, run_all, tokens_of
from .test_servicer import _with_server
from .test_vision_llava import JPEG, PNG, _processor_messages

MAX_NEW = 8
BLOCK = 8
ADAPTER = "demo-llava-r8"
PROMPTS: dict[str, Prompt] = {
    "describe_png": (ChatMessage("user", (ImagePart(PNG), " Look at it closely. Describe it in a few words.")),),
    "count_png": (ChatMessage("user", (ImagePart(PNG), " Look at it closely. How many colours does it have?")),),
    "describe_jpeg": (ChatMessage("user", (ImagePart(JPEG), " Look at it closely. Describe it in a few words.")),),
}


@pytest.fixture(scope="module")
def reference(llava_assets):
    models = VisionReferenceModels(llava_assets.name, llava_assets.base_dir,
                                   {name: ref.storage_path for name, ref in llava_assets.adapters.items()})

    @functools.cache
    def greedy(key: str):
        return models.greedy_messages(ADAPTER, _processor_messages(PROMPTS[key]), MAX_NEW)
    return greedy


@pytest.fixture(scope="module")
def prompt_ids(llava_assets) -> dict[str, tuple[list[int], int]]:
    """Prompt key -> (token ids, position of the first image token), as the engine encodes them."""
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(llava_assets.base_dir), 256,
                            AutoProcessor.from_pretrained(llava_assets.base_dir))
    encoded = {key: encoder.encode(prompt, MAX_NEW) for key, prompt in PROMPTS.items()}
    return {key: (e.token_ids, e.images.token_runs[0][0]) for key, e in encoded.items()}


def _run_one_by_one(engine: Engine, llava_assets, keys: list[str]) -> tuple[list[list[int]], list[int]]:
    """-> (each request's tokens, the prompt tokens each took from the prefix cache)."""
    tokens, hits = [], []
    for i, key in enumerate(keys):
        before = idle_stats(engine).prefix_cache_hit_tokens_total
        request = GenerationRequest(f"{key}-{i}", PROMPTS[key], SamplingParams(max_tokens=MAX_NEW),
                                    llava_assets.adapters[ADAPTER])
        (outputs,) = run_all(engine, [request])
        tokens.append(tokens_of(outputs))
        hits.append(idle_stats(engine).prefix_cache_hit_tokens_total - before)
    return tokens, hits


def test_repeated_image_is_not_encoded_again(llava_engine_factory, llava_assets, reference, encoder_calls):
    """Prefix caching off, so only the image cache can spare the vision tower."""
    keys = ["describe_png", "count_png", "describe_jpeg", "describe_png"]
    engine = llava_engine_factory(enable_prefix_caching=False)
    cached, _ = _run_one_by_one(engine, llava_assets, keys)
    assert encoder_calls == [1, 1]  # PNG once, JPEG once
    stats = idle_stats(engine)
    assert (stats.image_cache_hits_total, stats.image_cache_misses_total) == (2, 2)
    assert (stats.image_cache_entries, stats.image_cache_evictions_total) == (2, 0)
    assert stats.image_cache_capacity_bytes == WorkerConfig().image_cache_bytes
    assert 0 < stats.image_cache_bytes <= stats.image_cache_capacity_bytes
    metrics = CollectorRegistry()  # what the worker's /metrics shows (bind_engine_stats registers the same)
    metrics.register(CacheMetrics(engine))
    assert metrics.get_sample_value("tessera_worker_image_cache_hits_total") == 2
    assert metrics.get_sample_value("tessera_worker_image_cache_misses_total") == 2
    assert metrics.get_sample_value("tessera_worker_image_cache_bytes") == stats.image_cache_bytes
    uncached, _ = _run_one_by_one(llava_engine_factory(enable_prefix_caching=False, image_cache_bytes=0),
                                  llava_assets, keys)
    assert len(encoder_calls) == 2 + len(keys)
    assert cached == uncached
    for key, tokens in zip(keys, cached):
        assert_same_greedy(key, reference(key), tokens)


def test_a_full_image_cache_evicts_the_least_recently_used(llava_engine_factory, llava_assets):
    """A budget of one image's features: each new image evicts the one before."""
    engine = llava_engine_factory(enable_prefix_caching=False)
    _run_one_by_one(engine, llava_assets, ["describe_png"])
    one_image = idle_stats(engine).image_cache_bytes
    engine = llava_engine_factory(enable_prefix_caching=False, image_cache_bytes=one_image)
    _run_one_by_one(engine, llava_assets, ["describe_png", "count_png", "describe_jpeg", "describe_png"])
    stats = idle_stats(engine)
    assert (stats.image_cache_hits_total, stats.image_cache_misses_total) == (1, 3)
    assert (stats.image_cache_evictions_total, stats.image_cache_entries) == (2, 1)
    assert stats.image_cache_bytes == stats.image_cache_capacity_bytes == one_image


def test_get_stats_reports_image_cache_counters(llava_engine_factory, llava_assets):
    """Through the worker's GetStats RPC: the same image twice is one miss, then one hit."""
    engine = llava_engine_factory(enable_prefix_caching=False)

    async def body(stub):
        for request_id, text in (("first", " Describe it."), ("again", " How many colours?")):
            message = common_pb2.ChatMessage(role="user", parts=[common_pb2.ContentPart(image=PNG),
                                                                 common_pb2.ContentPart(text=text)])
            request = worker_pb2.WorkerGenerateRequest(request_id=request_id, base_model=engine.base_model,
                                                       chat=common_pb2.ChatPrompt(messages=[message]),
                                                       sampling=common_pb2.SamplingParams(max_tokens=2))
            assert [r async for r in stub.Generate(request)][-1].WhichOneof("payload") == "final"
        return await stub.GetStats(worker_pb2.GetStatsRequest())

    stats = asyncio.run(_with_server(engine, body))
    assert (stats.image_cache_hits_total, stats.image_cache_misses_total, stats.image_cache_entries) == (1, 1, 1)
    assert 0 < stats.image_cache_bytes <= stats.image_cache_capacity_bytes == WorkerConfig().image_cache_bytes
    assert stats.prefix_cache_query_tokens_total == 0, "prefix caching is off"


def test_prefix_with_an_image_is_shared_only_for_the_same_image(llava_engine_factory, llava_assets, reference,
                                                                 prompt_ids):
    """The image cache is off, so features come from the encoder each time a prefill needs them."""
    keys = ["describe_png", "count_png", "describe_jpeg"]
    engine = llava_engine_factory(kv_block_size=BLOCK, image_cache_bytes=0)
    tokens, hits = _run_one_by_one(engine, llava_assets, keys)
    png, count = prompt_ids["describe_png"][0], prompt_ids["count_png"][0]
    common = next(i for i, (a, b) in enumerate(zip(png, count)) if a != b)
    first_image = prompt_ids["describe_jpeg"][1]
    assert common // BLOCK * BLOCK > first_image + 16  # the shared blocks hold the whole image
    # Same image: every whole block of the common prefix. Another image, same text and ids: only the
    # blocks before the image.
    assert hits == [0, common // BLOCK * BLOCK, first_image // BLOCK * BLOCK]
    for key, got in zip(keys, tokens):
        assert_same_greedy(key, reference(key), got)
