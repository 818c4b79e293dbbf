"""The GPU tests' engines: the unit tests' tiny assets, on a float32 CUDA engine (unit tests imported into
a tests/gpu module run against it)."""

from __future__ import annotations

import pytest

from tests.unit.gpu_worker.conftest import make_engine, tiny_assets  # noqa: F401 (fixture)


@pytest.fixture
def engine_factory(tiny_assets):  # noqa: F811
    """Float32 CUDA engines (the unit tests' factory, on the GPU)."""
    engines = []

    def factory(steps=None, start=True, **fields):
        engines.append(make_engine(tiny_assets, steps, start, device="cuda", dtype="float32", kv_cache_tokens=2048,
                                   **fields))
        return engines[-1]
    yield factory
    for engine in engines:
        engine.stop()
