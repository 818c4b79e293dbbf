"""Feeds the WorkerStateTable from the workers' WatchState streams.

The gateway learns worker addresses from the registry; for each one a request is routed among,
it keeps one server-streaming WatchState call open, and each pushed state (every
`state_interval_ms`) becomes that worker's report. A stream that ends (the worker died or
restarted) forgets the worker at once — out of rotation — and the next request re-subscribes;
a stream that merely stalls goes stale in the table after `state_stale_s`.

A state is stamped when the gateway reads it, so a busy gateway makes a live worker look stale
too (2,000 requests arriving at once on two cores left 1.2 s between two states read), and a paused
worker process (SIGSTOP, a long GC, a swapped-out page) keeps its stream open and silent: a request
that finds its open stream's last state old waits for the next one (`settled`), and the core waits
again while any stream is `late` — a worker that is alive is waited for, not refused. A stream that
ended (the worker died: its connection was reset or refused) is not late: no request waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Collection, Iterable, MutableMapping

from services.common.errors import TesseraError
from tessera.v1 import worker_pb2

from policy.batch_summary import BatchEntry
from policy.perf_model import PerfModel
from policy.routing.worker_state import WorkerState, WorkerStateTable
from gateway.worker_client import WorkerClient

log = logging.getLogger(__name__)

RESUBSCRIBE_AFTER_S = 0.5  # after a stream fails, requests do not re-dial that worker sooner


def worker_state(address: str, message: worker_pb2.WorkerState, tightest_tpot_slo_s: float | None,
                 timestamp: float) -> WorkerState:
    """A pushed state as the scheduling core sees it, keyed by the address the gateway dials."""
    gpu = frozenset(message.gpu_adapters)
    return WorkerState(
        address=address, base_model=message.base_model, kind=message.perf_model,
        running=_entries(message.running), queued=_entries(message.queued), gpu_adapters=gpu,
        host_adapters=gpu | frozenset(message.host_adapters), gpu_adapter_slots=message.gpu_adapter_slots,
        max_batch=message.max_batch, free_kv_tokens=message.free_kv_tokens,
        tightest_tpot_slo_s=tightest_tpot_slo_s, timestamp=timestamp,
        loading_adapters=frozenset(message.loading_adapters) - gpu, gpu_victim_rate=message.gpu_victim_rate)


def _entries(loads: Iterable[worker_pb2.LoadEntry]) -> tuple[BatchEntry, ...]:
    return tuple(BatchEntry(e.adapter, e.rank, e.tokens) for e in loads)


class StateFeed:
    """Runs on the event loop only.

    `tightest_tpot_slo_s(address)`: the tightest TPOT SLO among this gateway's requests on a
    worker (workers do not know SLOs). `models`: the perf models the policy prices with, by worker kind
    (None: it prices nothing). Each worker reports its own in the first state of a stream, which goes
    into `models` under its kind; a worker whose kind has no model is not routed to (logged once per
    stream): no worker is priced with another kind's model.
    """

    def __init__(self, client: WorkerClient, table: WorkerStateTable, interval_ms: int,
                 tightest_tpot_slo_s: Callable[[str], float | None], models: MutableMapping[str, PerfModel] | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._table = table
        self._interval_ms = interval_ms
        self._tightest = tightest_tpot_slo_s
        self._models = models
        self._clock = clock
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._settled: dict[str, asyncio.Event] = {}  # per stream: set by its first state or its end
        self._news: dict[str, asyncio.Event] = {}  # per stream: set (and replaced) by each state and its end
        self._reported_at: dict[str, float] = {}  # per stream: its last state's stamp
        self._retry_at: dict[str, float] = {}

    def watch(self, addresses: Collection[str]) -> None:
        """Make sure a stream is open to each of `addresses` (idempotent)."""
        now = self._clock()
        for address in addresses:
            stream = self._streams.get(address)
            if (stream is None or stream.done()) and now >= self._retry_at.get(address, 0.0):
                self._settled[address] = asyncio.Event()
                self._news[address] = asyncio.Event()
                self._reported_at.pop(address, None)
                self._streams[address] = asyncio.create_task(self._follow(address), name=f"watch {address}")

    async def settled(self, addresses: Collection[str], stale_s: float, timeout_s: float) -> None:
        """Until the stream to each of `addresses` has pushed a first state or failed (workers just
        subscribed to: the first request after a start sees them all), at most `timeout_s`; then,
        while an open stream's last state is older than `stale_s` (the gateway's loop or the worker
        fell behind), until it pushes the next, again at most `timeout_s`."""
        waits = [asyncio.create_task(self._settled[a].wait()) for a in addresses
                 if a in self._settled and not self._settled[a].is_set()]
        if waits:
            try:
                await asyncio.wait(waits, timeout=timeout_s)
            finally:
                for wait in waits:
                    wait.cancel()
        horizon = self._clock() - stale_s
        late = [a for a in addresses if a in self._reported_at and self._reported_at[a] < horizon
                and not self._streams[a].done()]
        if late:
            news = [asyncio.create_task(self._news[a].wait()) for a in late]
            try:
                await asyncio.wait(news, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in news:
                    wait.cancel()

    def late(self, addresses: Collection[str], stale_s: float) -> list[str]:
        """Those of `addresses` whose stream is open but has pushed no state in the last `stale_s`
        (or none yet). A worker whose states come but name no usable model is not late: it is heard."""
        horizon = self._clock() - stale_s
        return [a for a in addresses if a in self._streams and not self._streams[a].done()
                and (not self._settled[a].is_set() or self._reported_at.get(a, horizon) < horizon)]

    async def close(self) -> None:
        for stream in self._streams.values():
            stream.cancel()
        for stream in self._streams.values():
            with contextlib.suppress(asyncio.CancelledError):
                await stream
        self._streams.clear()

    async def _follow(self, address: str) -> None:
        settled = self._settled[address]
        warned = False
        try:
            async for message in self._client.watch_state(address, self._interval_ms):
                if self._models is not None:
                    if message.perf_model_spec:
                        self._learn(address, message)
                    if message.perf_model not in self._models:
                        if not warned:
                            warned = True
                            log.warning("worker %s reported no usable performance model for its kind '%s': not "
                                        "routed to until it does", address, message.perf_model)
                        settled.set()  # a first state came: requests waiting for it go on without this worker
                        continue
                # Stamped one interval back: a dispatch in the last interval may not be in this state
                # yet, so the table keeps counting it (twice at worst, never not at all).
                at = self._clock() - self._interval_ms / 1e3
                self._table.report(worker_state(address, message, self._tightest(address), at))
                self._reported_at[address] = at
                settled.set()
                self._announce(address)
        except TesseraError as exc:
            log.info("state stream from %s ended: %s", address, exc.message)
        finally:
            settled.set()
            self._table.forget(address)
            self._reported_at.pop(address, None)
            self._announce(address)
            self._retry_at[address] = self._clock() + RESUBSCRIBE_AFTER_S

    def _learn(self, address: str, message: worker_pb2.WorkerState) -> None:
        """The worker's own model, under its kind (it prices every worker of that kind)."""
        assert self._models is not None
        try:
            model = PerfModel.from_json(json.loads(message.perf_model_spec))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("worker %s sent a malformed performance model (%s)", address, exc)
            return
        if model.kind != message.perf_model:
            log.warning("worker %s sent the model of kind '%s' for its kind '%s'", address, model.kind,
                        message.perf_model)
            return
        if self._models.get(model.kind) != model:
            log.info("worker %s prices itself with its model of %s (%s)", address, model.kind, model.source)
        self._models[model.kind] = model

    def _announce(self, address: str) -> None:
        """Wake the requests waiting for this stream's next state (or its end)."""
        self._news[address].set()
        self._news[address] = asyncio.Event()
