"""The gateway's last good snapshot of registry metadata: base models, adapters, healthy workers.

Refreshed in the background every `metadata_refresh_s`. A failed refresh keeps the old
snapshot, so a registry restart never fails a request that the snapshot can answer. A name
the snapshot does not know triggers one immediate refresh (at most one per
`miss_refresh_interval_s`, shared by concurrent misses) before the answer is NOT_FOUND, so a
just-registered adapter is usable at once. The registry's change feed (WatchCatalog) makes a
deleted adapter stop resolving as soon as the registry commits the deletion, not at the next
refresh: the name leaves the snapshot on the spot, and a refresh that was already under way when
the change came cannot bring it back (what it read may predate the deletion).

A `model` of "task:<name>" names a task (docs/fuse.md, "Routing by task"): it resolves to the adapter that
serves it, the newest registration among those whose `tasks` name it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence

import grpc

from services.common.errors import NotFound, Unavailable
from services.common.tls import aio_channel
from tessera.v1 import common_pb2, registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

REGISTRY_CALL_TIMEOUT_S = 2.0
MISS_REFRESH_INTERVAL_S = 0.5
WATCH_RETRY_S = 1.0  # after the change feed fails (the registry restarts; one that has no feed)
# Reconnect fast after a registry restart: gRPC's default backoff grows to two minutes.
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000))
TASK_PREFIX = "task:"  # `model`: "task:shape" -> the adapter serving task "shape" (the registry refuses such names)


@dataclasses.dataclass(frozen=True, slots=True)
class ResolvedModel:
    """What a client's `model` names: a base model, optionally with one adapter on top."""

    base_model: str
    adapter: common_pb2.Adapter | None
    architecture: str = ""  # the base model's, as registered ("LlamaForCausalLM"); "" if unknown


@dataclasses.dataclass(frozen=True, slots=True)
class RegistrySnapshot:
    base_models: dict[str, common_pb2.BaseModel]
    adapters: dict[str, common_pb2.Adapter]
    workers: tuple[common_pb2.WorkerInfo, ...]  # healthy ones only
    tasks: dict[str, common_pb2.Adapter]  # task name -> the adapter serving it (task_index)


def task_index(adapters: Iterable[common_pb2.Adapter]) -> dict[str, common_pb2.Adapter]:
    """Each task named by an adapter's `tasks` -> the newest adapter naming it (by registration time, then name:
    every gateway picks the same one)."""
    index: dict[str, common_pb2.Adapter] = {}
    for adapter in sorted(adapters, key=lambda a: (a.created_unix_ms, a.name)):
        index.update((task.name, adapter) for task in adapter.tasks)
    return index


class RegistryCache:
    """Owns the channel to the registry; every method runs on the gateway's event loop."""

    def __init__(self, registry_address: str, refresh_s: float,
                 miss_refresh_interval_s: float = MISS_REFRESH_INTERVAL_S,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        """`credentials`: the gateway's cluster certificate (mutual TLS); None dials plaintext."""
        self._address = registry_address
        self._refresh_s = refresh_s
        self._miss_refresh_interval_s = miss_refresh_interval_s
        self._channel = aio_channel(registry_address, credentials, CHANNEL_OPTIONS)
        self._stub = registry_pb2_grpc.RegistryStub(self._channel)
        self._snapshot: RegistrySnapshot | None = None
        self._last_attempt = -float("inf")
        self._registry_ok = True
        self._refresh_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._changed = asyncio.Event()  # the change feed asks for a refresh before the next periodic one
        self._refreshes = 0  # refreshes started so far
        # Adapters the change feed said were deleted -> how many refreshes had started by then: a
        # refresh started no later than that may have read them still there.
        self._removed: dict[str, int] = {}

    async def start(self) -> None:
        """First refresh (a down registry is logged, not fatal), then refresh in the background and
        follow the registry's change feed."""
        await self.refresh()
        self._tasks = [asyncio.create_task(self._refresh_forever(), name="registry-cache-refresh"),
                       asyncio.create_task(self._follow_changes(), name="registry-cache-changes")]

    async def close(self) -> None:
        # The loops also stop on this flag: Python 3.11's wait_for drops a cancellation that lands as what
        # it waits for completes (a change announced as the gateway closes), and the loop would go on.
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._channel.close()

    async def refresh(self) -> bool:
        """Fetch a new snapshot; on failure keep the old one. True if it succeeded."""
        async with self._refresh_lock:
            return await self._refresh_locked()

    async def _refresh_locked(self) -> bool:
        self._last_attempt = time.monotonic()
        self._refreshes += 1
        started = self._refreshes
        try:
            base_models, adapters, workers = await asyncio.gather(
                self._stub.ListBaseModels(registry_pb2.ListBaseModelsRequest(), timeout=REGISTRY_CALL_TIMEOUT_S),
                self._stub.ListAdapters(registry_pb2.ListAdaptersRequest(), timeout=REGISTRY_CALL_TIMEOUT_S),
                self._stub.ListWorkers(registry_pb2.ListWorkersRequest(healthy_only=True),
                                       timeout=REGISTRY_CALL_TIMEOUT_S))
        except grpc.RpcError as exc:
            if self._registry_ok:  # log the change, not every retry while the registry is down
                state = "keeping the last snapshot" if self._snapshot else "no snapshot yet"
                log.warning("registry %s refresh failed (%s: %s); %s", self._address, exc.code().name,
                            exc.details(), state)
            self._registry_ok = False
            return False
        if not self._registry_ok:
            log.info("registry %s answered; metadata refreshed", self._address)
        self._registry_ok = True
        # Deletions announced while this refresh was under way stay out; those announced before it began
        # are in what it read.
        self._removed = {name: at for name, at in self._removed.items() if at >= started}
        kept = {a.name: a for a in adapters.adapters if a.name not in self._removed}
        self._snapshot = RegistrySnapshot(
            base_models={m.name: m for m in base_models.base_models}, adapters=kept,
            workers=tuple(w for w in workers.workers if w.healthy), tasks=task_index(kept.values()))
        return True

    async def _refresh_forever(self) -> None:
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self._refresh_s)
            self._changed.clear()
            await self.refresh()

    async def _follow_changes(self) -> None:
        """Follow WatchCatalog: drop deleted adapters at once, and ask for a refresh on every change (and
        on each (re)subscription, which starts with an empty change: changes made while away are caught
        up). A slow refresh never holds up the next change."""
        while not self._closing:
            try:
                async for change in self._stub.WatchCatalog(registry_pb2.WatchCatalogRequest()):
                    self._remove_adapters(change.removed_adapters)
                    self._changed.set()
            except grpc.RpcError as exc:
                log.debug("registry change feed: %s; following again in %.1fs", exc.code().name, WATCH_RETRY_S)
            await asyncio.sleep(WATCH_RETRY_S)

    def _remove_adapters(self, names: Sequence[str]) -> None:
        if not names:
            return
        for name in names:
            self._removed[name] = self._refreshes
        if self._snapshot is not None:
            kept = {name: adapter for name, adapter in self._snapshot.adapters.items() if name not in self._removed}
            self._snapshot = dataclasses.replace(self._snapshot, adapters=kept, tasks=task_index(kept.values()))
        log.info("adapters deleted in the registry: %s", ", ".join(names))

    async def _refresh_after_miss(self) -> None:
        """One refresh unless one was attempted very recently; concurrent misses share it."""
        async with self._refresh_lock:
            if time.monotonic() - self._last_attempt >= self._miss_refresh_interval_s:
                await self._refresh_locked()

    def _require_snapshot(self) -> RegistrySnapshot:
        if self._snapshot is None:
            raise Unavailable(f"the model registry at {self._address} has not answered yet; retry shortly")
        return self._snapshot

    async def snapshot(self) -> RegistrySnapshot:
        """The current snapshot; refreshes first if the registry was never reached."""
        if self._snapshot is None:
            await self._refresh_after_miss()
        return self._require_snapshot()

    async def resolve(self, model: str) -> ResolvedModel:
        """A base model's name -> no adapter; an adapter's name -> it and its base model."""
        resolved = self._lookup(model)
        if resolved is None:
            await self._refresh_after_miss()
            resolved = self._lookup(model)
        if resolved is None:
            self._require_snapshot()
            what = (f"task '{model[len(TASK_PREFIX):]}' is served by no adapter" if model.startswith(TASK_PREFIX)
                    else f"model '{model}' does not exist")
            raise NotFound(f"{what}; the available models are listed by GET /v1/models (REST) and ListModels "
                           "(gRPC)", param="model")
        return resolved

    def _lookup(self, model: str) -> ResolvedModel | None:
        if self._snapshot is None:
            return None
        if model in self._snapshot.base_models:
            return ResolvedModel(model, None, self._snapshot.base_models[model].architecture)
        if model.startswith(TASK_PREFIX):
            adapter = self._snapshot.tasks.get(model[len(TASK_PREFIX):])
        else:
            adapter = self._snapshot.adapters.get(model)
        if adapter is None:
            return None
        base = self._snapshot.base_models.get(adapter.base_model)
        return ResolvedModel(adapter.base_model, adapter, base.architecture if base else "")

    async def workers_for(self, base_model: str) -> list[common_pb2.WorkerInfo]:
        """Healthy workers serving `base_model`; refreshes once if there are none."""
        workers = self._workers_in_snapshot(base_model)
        if not workers:
            await self._refresh_after_miss()
            workers = self._workers_in_snapshot(base_model)
        return workers

    def _workers_in_snapshot(self, base_model: str) -> list[common_pb2.WorkerInfo]:
        if self._snapshot is None:
            return []
        return [w for w in self._snapshot.workers if w.base_model == base_model]
