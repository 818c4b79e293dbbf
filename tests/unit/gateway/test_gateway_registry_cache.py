"""RegistryCache against a fake registry server: resolve, refresh on a miss, a registry that goes away, deletions from the change feed."""

from __future__ import annotations

import asyncio

import pytest

from gateway.registry_cache import RegistryCache
from tests.unit.gateway.gateway_fakes import ADAPTER, BASE, FakeRegistry, start_fake_server
from services.common.errors import NotFound, Unavailable
from tessera.v1 import common_pb2, registry_pb2, registry_pb2_grpc


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
            with pytest.raises(NotFound, match=r"model 'nope' does not exist; the available models are listed by GET /v1/models \(REST\) and ListModels \(gRPC\)"):
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
            await _until(lambda: registry.list_calls == 2)  # start()'s refresh, then the change feed's first
            registry.adapters.append(common_pb2.Adapter(name="new-lora", base_model=BASE, rank=4))
            await asyncio.sleep(0.25)  # past the rate limit that those refreshes set
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


class WatchedRegistry(FakeRegistry):
    """A registry with a change feed; `gate` holds ListAdapters answers (a refresh under way) with the
    adapters as they were when the call came."""

    def __init__(self) -> None:
        super().__init__()
        self.changes: asyncio.Queue[registry_pb2.CatalogChange] = asyncio.Queue()
        self.watching = asyncio.Event()
        self.gate = asyncio.Event()
        self.gate.set()
        self.adapter_calls = 0

    async def ListAdapters(self, request, context):
        self.adapter_calls += 1
        adapters = list(self.adapters)
        await self.gate.wait()
        return registry_pb2.ListAdaptersResponse(adapters=adapters)

    async def WatchCatalog(self, request, context):
        yield registry_pb2.CatalogChange()
        self.watching.set()
        while True:
            yield await self.changes.get()

    def delete(self, name: str) -> None:
        self.adapters = [a for a in self.adapters if a.name != name]
        self.changes.put_nowait(registry_pb2.CatalogChange(removed_adapters=[name]))


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_a_deleted_adapter_stops_resolving_when_the_registry_announces_it() -> None:
    async def scenario() -> None:
        registry = WatchedRegistry()
        server, port = await start_fake_server(registry, registry_pb2_grpc.add_RegistryServicer_to_server)
        # No background refresh and no refresh on a miss for a minute: only the change feed can tell.
        cache = RegistryCache(f"127.0.0.1:{port}", refresh_s=60, miss_refresh_interval_s=60)
        await cache.start()
        try:
            await asyncio.wait_for(registry.watching.wait(), 5)
            assert (await cache.resolve(ADAPTER)).adapter.name == ADAPTER
            registry.delete(ADAPTER)
            await _until(lambda: ADAPTER not in cache._snapshot.adapters)
            with pytest.raises(NotFound, match=f"model '{ADAPTER}' does not exist"):
                await cache.resolve(ADAPTER)
            assert (await cache.resolve(BASE)).adapter is None  # everything else resolves as before
        finally:
            await cache.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_refresh_under_way_at_a_deletion_does_not_bring_the_adapter_back() -> None:
    async def scenario() -> None:
        registry = WatchedRegistry()
        registry.adapters.append(common_pb2.Adapter(name="kept", base_model=BASE, rank=4))
        server, port = await start_fake_server(registry, registry_pb2_grpc.add_RegistryServicer_to_server)
        cache = RegistryCache(f"127.0.0.1:{port}", refresh_s=60, miss_refresh_interval_s=60)
        await cache.start()
        try:
            await asyncio.wait_for(registry.watching.wait(), 5)
            # The refreshes at start and on subscribing are over; none other comes for a minute.
            await _until(lambda: registry.adapter_calls == 2 and not cache._refresh_lock.locked())
            registry.gate.clear()
            calls = registry.adapter_calls
            in_flight = asyncio.create_task(cache.refresh())   # reads the adapters before the deletion
            await _until(lambda: registry.adapter_calls == calls + 1)
            registry.delete(ADAPTER)
            await _until(lambda: ADAPTER not in cache._snapshot.adapters)
            registry.gate.set()
            assert await in_flight
            assert set(cache._snapshot.adapters) == {"kept"}  # the stale read did not restore it
            with pytest.raises(NotFound):
                await cache.resolve(ADAPTER)
            registry.adapters.append(common_pb2.Adapter(name=ADAPTER, base_model=BASE, rank=16))  # registered again
            registry.changes.put_nowait(registry_pb2.CatalogChange())
            await _until(lambda: ADAPTER in cache._snapshot.adapters)
            assert (await cache.resolve(ADAPTER)).adapter.rank == 16
        finally:
            await cache.close()
            await server.stop(0)

    asyncio.run(scenario())



def test_close_returns_even_where_a_loop_loses_its_cancellation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.11's wait_for drops a cancellation that lands as what it waits for completes (here: a
    change announced as the gateway closes); the refresh loop then went on and close() hung now and then
    (a gateway test's teardown, about once in twenty runs). Here every such cancellation is dropped."""
    real_wait_for = asyncio.wait_for

    async def dropping_wait_for(awaitable, timeout):
        try:
            return await real_wait_for(awaitable, timeout)
        except asyncio.CancelledError:
            return None  # as 3.11's wait_for does when what it waited for completed at that moment

    async def scenario() -> None:
        registry, server, address = await started_registry()
        cache = RegistryCache(address, refresh_s=60)
        await cache.start()
        try:
            monkeypatch.setattr(asyncio, "wait_for", dropping_wait_for)
            await real_wait_for(cache.close(), 5)
        finally:
            monkeypatch.undo()
            await server.stop(0)

    asyncio.run(scenario())
