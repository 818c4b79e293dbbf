"""RegistryCache against a fake registry server: resolve, refresh on a miss, a registry that goes away."""

from __future__ import annotations

import asyncio

import pytest

from gateway.registry_cache import RegistryCache
from tests.unit.gateway.gateway_fakes import ADAPTER, BASE, FakeRegistry, start_fake_server
from services.common.errors import NotFound, Unavailable
from tessera.v1 import common_pb2, registry_pb2_grpc


async def started_registry() -> tuple[FakeRegistry, object, str]:
    registry = FakeRegistry()
    server, port = await start_fake_server(registry, registry_pb2_grpc.add_RegistryServicer_to_server)
    return registry, server, f"127.0.0.1:{port}"


def test_resolve_base_adapter_and_unknown() -> None:
    async def scenario() -> None:
        registry, server, address = await started_registry()
        cache = RegistryCache(address, refresh_s=60)
        await cache.start()
        try:
            base = await cache.resolve(BASE)
            assert (base.base_model, base.adapter) == (BASE, None)
            adapter = await cache.resolve(ADAPTER)
            assert adapter.base_model == BASE and adapter.adapter.name == ADAPTER and adapter.adapter.rank == 8
            with pytest.raises(NotFound, match="model 'nope' does not exist; GET /v1/models"):
                await cache.resolve("nope")
        finally:
            await cache.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_miss_refreshes_once_and_finds_a_new_adapter() -> None:
    async def scenario() -> None:
        registry, server, address = await started_registry()
        cache = RegistryCache(address, refresh_s=60, miss_refresh_interval_s=0.2)
        await cache.start()
        try:
            registry.adapters.append(common_pb2.Adapter(name="new-lora", base_model=BASE, rank=4))
            await asyncio.sleep(0.25)  # past the rate limit that start()'s refresh set
            assert (await cache.resolve("new-lora")).adapter.rank == 4
            calls = registry.list_calls
            # Concurrent misses right after a refresh share it instead of hammering the registry.
            results = await asyncio.gather(*(cache.resolve("missing") for _ in range(5)), return_exceptions=True)
            assert all(isinstance(r, NotFound) for r in results)
            assert registry.list_calls == calls
        finally:
            await cache.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_background_refresh_picks_up_workers() -> None:
    async def scenario() -> None:
        registry, server, address = await started_registry()
        cache = RegistryCache(address, refresh_s=0.05)
        await cache.start()
        try:
            assert (await cache.snapshot()).workers == ()
            registry.workers.append(common_pb2.WorkerInfo(address="w:1", base_model=BASE, healthy=True))
            await asyncio.sleep(0.3)
            assert [w.address for w in (await cache.snapshot()).workers] == ["w:1"]
        finally:
            await cache.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_registry_down_keeps_the_snapshot() -> None:
    async def scenario() -> None:
        registry, server, address = await started_registry()
        cache = RegistryCache(address, refresh_s=0.05, miss_refresh_interval_s=0.0)
        await cache.start()
        try:
            await server.stop(0)
            await asyncio.sleep(0.2)  # several failed background refreshes
            assert not await cache.refresh()
            assert (await cache.resolve(ADAPTER)).base_model == BASE
            with pytest.raises(NotFound):
                await cache.resolve("nope")
            assert [m.name for m in (await cache.snapshot()).base_models.values()] == [BASE, "tiny-qwen"]
        finally:
            await cache.close()

    asyncio.run(scenario())


def test_registry_never_reached_is_unavailable() -> None:
    async def scenario() -> None:
        registry, server, address = await started_registry()
        await server.stop(0)
        cache = RegistryCache(address, refresh_s=60, miss_refresh_interval_s=0.0)
        await cache.start()
        try:
            with pytest.raises(Unavailable, match="has not answered yet"):
                await cache.resolve(BASE)
            with pytest.raises(Unavailable):
                await cache.snapshot()
        finally:
            await cache.close()

    asyncio.run(scenario())
