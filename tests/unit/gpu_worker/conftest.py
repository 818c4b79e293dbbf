"""Shared tiny assets: one small Llama and the three demo adapters, built once per session."""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpu_worker.builder import build_engine
from gpu_worker.engine import Engine, EngineStats, GenerationRequest, RequestOutput, StepRecord
from gpu_worker.lora.loader import AdapterRef
from services.config import WorkerConfig
from services.demo_assets import DEMO_ADAPTERS, DEMO_BASE_MODEL, build_llama, build_lora_adapter


@dataclass(frozen=True)
class TinyAssets:
    base_dir: Path
    store: Path
    adapters: dict[str, AdapterRef]


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> TinyAssets:
    root = tmp_path_factory.mktemp("assets")
    base = build_llama(root / "base", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=128, max_position_embeddings=256)
    store = root / "store"
    adapters = {}
    for spec in DEMO_ADAPTERS:
        directory = build_lora_adapter(base, store / spec.name, spec)
        digest = hashlib.sha256((directory / "adapter_model.safetensors").read_bytes()).hexdigest()
        adapters[spec.name] = AdapterRef(spec.name, DEMO_BASE_MODEL, spec.rank, digest, str(directory))
    return TinyAssets(base, store, adapters)


def make_engine(assets: TinyAssets, steps: list[StepRecord] | None = None, **worker_fields) -> Engine:
    worker = WorkerConfig(base_model=DEMO_BASE_MODEL, **worker_fields)
    engine = build_engine(assets.base_dir, worker, assets.store,
                          on_step=steps.append if steps is not None else None)
    engine.start()
    return engine


@pytest.fixture
def engine_factory(tiny_assets):
    engines: list[Engine] = []

    def factory(steps: list[StepRecord] | None = None, **worker_fields) -> Engine:
        engines.append(make_engine(tiny_assets, steps, **worker_fields))
        return engines[-1]

    yield factory
    for engine in engines:
        engine.stop()


async def collect(engine: Engine, request: GenerationRequest) -> list[RequestOutput]:
    return [out async for out in engine.submit(request, asyncio.get_running_loop())]


def run_all(engine: Engine, requests: list[GenerationRequest]) -> list[list[RequestOutput]]:
    """Submit every request at once (so they share batches) and collect each one's outputs."""
    async def main():
        return await asyncio.gather(*(collect(engine, r) for r in requests))
    return asyncio.run(main())


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def idle_stats(engine: Engine, timeout_s: float = 10.0) -> EngineStats:
    """The engine's stats once nothing runs (they are published at the end of each step)."""
    deadline = time.monotonic() + timeout_s
    while engine.stats().running_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.stats()
