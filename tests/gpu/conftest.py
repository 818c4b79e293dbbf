"""The GPU tests' engines: the unit tests' tiny assets, on a float32 CUDA engine (unit tests imported into
a tests/gpu module run against it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gpu_worker.engine import Engine
from tests.unit.gpu_worker.conftest import TinyAssets, make_engine, tiny_assets  # noqa: F401 (fixture)


def cuda_engines(assets: TinyAssets) -> Iterator[Callable[..., Engine]]:
    """A factory of float32 CUDA engines on `assets` (the unit tests' factory, on the GPU), stopped at teardown."""
    engines: list[Engine] = []

    def factory(steps=None, start=True, **fields) -> Engine:
        engines.append(make_engine(assets, steps, start, device="cuda", dtype="float32", kv_cache_tokens=2048,
                                   **fields))
        return engines[-1]
    yield factory
    for engine in engines:
        engine.stop()


@pytest.fixture
def engine_factory(tiny_assets):  # noqa: F811
    yield from cuda_engines(tiny_assets)
