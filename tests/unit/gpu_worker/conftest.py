"""Shared tiny assets, built once per session: one small Llama and the three demo adapters; one small
LLaVA-1.5 and one small Qwen2-VL on the same tokenizer, each with its two demo adapters."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from gpu_worker.builder import build_engine
from gpu_worker.delivery import RequestHandle, RequestOutput
from gpu_worker.engine import Engine, StepRecord
from gpu_worker.intake import GenerationRequest
from gpu_worker.stats import EngineStats
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.models.llava import LlavaImageEncoder
from services.common.adapter_layout import directory_digest
from services.common.config import WorkerConfig
from services.demo_assets import (DEMO_ADAPTERS, DEMO_BASE_MODEL, DEMO_QWEN2VL_ADAPTERS, DEMO_QWEN2VL_BASE_MODEL,
                                  DEMO_VISION_ADAPTERS, DEMO_VISION_BASE_MODEL, ClipShape, DemoAdapterSpec, LlamaShape,
                                  Qwen2VLVisionShape, build_llama, build_llava, build_lora_adapter, build_qwen2vl)

# Small enough for fast CPU tests, with GQA (4 heads, 2 KV heads) like real checkpoints.
TINY_LLAMA = LlamaShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                        max_position_embeddings=256)
# 32 px images in 8 px patches: 16 image tokens per image.
TINY_CLIP = ClipShape(image_size=32, patch_size=8, hidden_size=32, num_layers=2, num_heads=4)
# 8 px patches merged 2 x 2: 16 px per image token side, images resized to 256..2304 pixels (1 to 9 tokens).
TINY_QWEN2VL = Qwen2VLVisionShape(embed_dim=32, depth=2, num_heads=4, patch_size=8, merge=2,
                                  min_pixels=16 * 16, max_pixels=48 * 48)


@dataclass(frozen=True)
class TinyAssets:
    base_dir: Path
    store: Path
    adapters: dict[str, AdapterRef]
    name: str = DEMO_BASE_MODEL


def _adapters(base: Path, store: Path, specs: tuple[DemoAdapterSpec, ...], base_name: str) -> dict[str, AdapterRef]:
    adapters = {}
    for spec in specs:
        directory = build_lora_adapter(base, store / spec.name, spec)
        adapters[spec.name] = AdapterRef(spec.name, base_name, spec.rank, directory_digest(directory), str(directory))
    return adapters


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> TinyAssets:
    root = tmp_path_factory.mktemp("assets")
    base = build_llama(root / "base", shape=TINY_LLAMA)
    store = root / "store"
    return TinyAssets(base, store, _adapters(base, store, DEMO_ADAPTERS, DEMO_BASE_MODEL))


def _vision_assets(root: Path, build_base: Callable[[Path], Path], specs: tuple[DemoAdapterSpec, ...],
                   base_name: str) -> TinyAssets:
    """A vision model built by `build_base` under root/base and its demo adapters under root/store."""
    base, store = build_base(root / "base"), root / "store"
    return TinyAssets(base, store, _adapters(base, store, specs, base_name), base_name)


@pytest.fixture(scope="session")
def llava_assets(tiny_assets, tmp_path_factory) -> TinyAssets:
    return _vision_assets(
        tmp_path_factory.mktemp("llava"),
        lambda d: build_llava(d, tokenizer_dir=tiny_assets.base_dir, text=TINY_LLAMA, vision=TINY_CLIP),
        DEMO_VISION_ADAPTERS, DEMO_VISION_BASE_MODEL)


@pytest.fixture(scope="session")
def qwen2vl_assets(tiny_assets, tmp_path_factory) -> TinyAssets:
    return _vision_assets(
        tmp_path_factory.mktemp("qwen2vl"),
        lambda d: build_qwen2vl(d, tokenizer_dir=tiny_assets.base_dir, text=TINY_LLAMA, vision=TINY_QWEN2VL),
        DEMO_QWEN2VL_ADAPTERS, DEMO_QWEN2VL_BASE_MODEL)


def make_engine(assets: TinyAssets, steps: list[StepRecord] | None = None, start: bool = True,
                **worker_fields) -> Engine:
    """`start` False: built, its thread not started (`run_together` starts it)."""
    # No CPU LoRA worker process unless a test asks for one (they are the served default).
    worker = WorkerConfig(base_model=assets.name, **{"cpu_lora_workers": 0, **worker_fields})
    if worker.device == "cuda":
        # An engine sizes its KV cache to most of the GPU: what earlier tests' engines held must be
        # freed and given back first (tests/conftest.py: expandable segments, so that all of it can be).
        gc.collect()
        torch.cuda.empty_cache()
    engine = build_engine(assets.base_dir, worker, assets.store,
                          on_step=steps.append if steps is not None else None)
    if start:
        engine.start()
    return engine


def _engines(assets: TinyAssets) -> Iterator[Callable[..., Engine]]:
    """A factory of started engines on `assets`, all stopped at teardown."""
    engines: list[Engine] = []

    def factory(steps: list[StepRecord] | None = None, start: bool = True, **worker_fields) -> Engine:
        engines.append(make_engine(assets, steps, start, **worker_fields))
        return engines[-1]

    yield factory
    for engine in engines:
        engine.stop()


@pytest.fixture
def engine_factory(tiny_assets):
    yield from _engines(tiny_assets)


@pytest.fixture
def llava_engine_factory(llava_assets):
    yield from _engines(llava_assets)


@pytest.fixture
def qwen2vl_engine_factory(qwen2vl_assets):
    yield from _engines(qwen2vl_assets)


@pytest.fixture
def encoder_calls(monkeypatch) -> list[int]:
    """Counts LlavaImageEncoder forward passes: each entry is how many images one pass encoded."""
    calls: list[int] = []
    forward = LlavaImageEncoder.forward

    def counted(self, pixel_values):
        calls.append(pixel_values.shape[0])
        return forward(self, pixel_values)
    monkeypatch.setattr(LlavaImageEncoder, "forward", counted)
    return calls


async def collect(engine: Engine, request: GenerationRequest) -> list[RequestOutput]:
    return [out async for out in engine.submit(request, asyncio.get_running_loop())]


def run_all(engine: Engine, requests: list[GenerationRequest]) -> list[list[RequestOutput]]:
    """Submit every request at once (so they share batches) and collect each one's outputs."""
    async def main():
        return await asyncio.gather(*(collect(engine, r) for r in requests))
    return asyncio.run(main())


def run_together(engine: Engine, requests: list[GenerationRequest]) -> list[list[RequestOutput]]:
    """Every request's outputs, on an engine built unstarted: their adapters are loaded onto the GPU first,
    then every request is queued, then the engine starts, so its first step sees them all. With `run_all`
    the batches depend on how the submits race the engine thread and the adapters' loads (a mixture-mode
    test found its mixed prefill step in 9 of 24 runs on an H200)."""
    adapters = engine._adapters
    refs = list({r.adapter.sha256: r.adapter for r in requests if r.adapter is not None}.values())
    for ref in refs:
        adapters.load_now(ref)
    for ref in refs:
        adapters.depart(ref)  # resident, no longer held: the requests hold them from here

    async def main():
        loop = asyncio.get_running_loop()
        handles = [engine.submit(request, loop) for request in requests]
        engine.start()
        return await asyncio.gather(*(_outputs(handle) for handle in handles))
    return asyncio.run(main())


async def _outputs(handle: RequestHandle) -> list[RequestOutput]:
    return [out async for out in handle]


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def idle_stats(engine: Engine, timeout_s: float = 10.0) -> EngineStats:
    """The engine's stats once nothing runs (they are published at the end of each step)."""
    deadline = time.monotonic() + timeout_s
    while engine.stats().running_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.stats()
