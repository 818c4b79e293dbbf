"""The worker's side of WatchState: its engine's load and adapter tiers, pushed on an interval.

The gateway's router reads these (gateway/state_feed.py) to price each worker with its
performance model; a stream that stops is how the gateway notices a worker is gone.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gpu_worker.engine import Engine
from gpu_worker.stats import SeqLoad
from services.common.errors import InvalidArgument
from policy.perf_model import PerfModel
from tessera.v1 import worker_pb2

MIN_INTERVAL_MS, MAX_INTERVAL_MS = 10, 1000


@dataclass(frozen=True)
class StateSource:
    engine: Engine
    perf_model: PerfModel  # what this worker's steps follow (gpu_worker/pricing.py); its kind names it
    max_batch: int   # max concurrent sequences (WorkerConfig.max_num_seqs)

    def snapshot(self) -> worker_pb2.WorkerState:
        s = self.engine.stats()
        tiers = s.adapters  # by name: where a new request's adapter (its newest version) is now
        return worker_pb2.WorkerState(
            base_model=self.engine.base_model, perf_model=self.perf_model.kind,
            running=[_entry(e) for e in s.running_load], queued=[_entry(e) for e in s.waiting_load],
            gpu_adapters=tiers.gpu_adapters, host_adapters=tiers.host_adapters,
            loading_adapters=tiers.loading_adapters, gpu_victim_rate=tiers.gpu_victim_rate,
            gpu_adapter_slots=s.adapter_slots,
            max_batch=self.max_batch, free_kv_tokens=s.free_kv_tokens)

    async def watch(self, interval_ms: int) -> AsyncIterator[worker_pb2.WorkerState]:
        if not MIN_INTERVAL_MS <= interval_ms <= MAX_INTERVAL_MS:
            raise InvalidArgument(f"interval_ms must be between {MIN_INTERVAL_MS} and {MAX_INTERVAL_MS}, "
                                  f"got {interval_ms}", param="interval_ms")
        first = self.snapshot()
        first.perf_model_spec = json.dumps(self.perf_model.to_json())  # once per stream: it never changes
        yield first
        while True:
            await asyncio.sleep(interval_ms / 1e3)
            yield self.snapshot()


def _entry(load: SeqLoad) -> worker_pb2.LoadEntry:
    return worker_pb2.LoadEntry(adapter=load.adapter or "", rank=load.rank, tokens=load.tokens)
