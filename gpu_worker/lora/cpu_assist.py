"""CPU-assisted prefill (CaraServe): a request whose adapter is in the host tier but not usable on the
GPU yet (cold_start.py decides when this way is the fastest) starts at once, its LoRA deltas
computed by the worker's CPU LoRA workers from the host copy, layer by layer, over shared memory
(services/common/cpu_lora/shm.py); it switches to the GPU kernels at the first step after its adapter
becomes usable there (scheduler.py).

`CpuLoraPool` sends jobs to the CPU LoRA workers that a `CpuLoraSupervisor` runs as this process's
children, pinned to their cores, or that a sidecar container runs (`SidecarWorkers`; both in
services/common/cpu_lora/), has one that died started again (a watcher thread looks every second, and
every job looks first), and computes a job's share itself when a worker dies or fails mid-job (the same
arithmetic, services/common/cpu_lora/delta.py), so that no output changes and nothing is lost.
`CpuLoraStep` is one step's CPU-assisted rows: every LoRA projection sends them to the pool before its
own kernels and adds the deltas after (layer.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker.lora.host_weights import HostPages, PackedAdapter
from gpu_worker.lora.layer import LoRALinear
from kernels.lora_stack import packed_layout
from services.common.cpu_lora.delta import lora_delta
from services.common.cpu_lora.shm import RATE_RANKS, RATES, Job, Segment, Shape, WorkArea, even_shares
from services.common.cpu_lora.sidecar import SidecarWorkers
from services.common.cpu_lora.supervisor import CpuLoraSupervisor
from services.common.shm_claims import ShmClaim

log = logging.getLogger(__name__)

JOB_TIMEOUT_S = 30.0  # a live worker that has not answered by then is stuck: killed, its share done here
MIN_SHARE_S = 1e-3    # a share smaller than this much of a core's work is not worth waking another worker


def workers_for(tokens: int, rate: int, available: int) -> int:
    """How many workers a job of `tokens` gets at one core's `rate` (tokens/s): one per MIN_SHARE_S of
    work, at least one, at most `available` (all of them when the rate is unknown). A decode's token
    goes to one worker instead of waking them all."""
    if not rate:
        return available
    return max(1, min(available, math.ceil(tokens / (rate * MIN_SHARE_S))))


@dataclass(frozen=True)
class CpuLoraStats:
    workers: int = 0        # configured
    ready: int = 0          # answering jobs now
    jobs: int = 0           # projections' jobs posted to them
    local_shares: int = 0   # shares the engine computed itself (a worker dead, stuck or failing)
    restarts: int = 0


class CpuLoraPool:
    def __init__(self, shm: ShmClaim, host: HostPages, dtype: torch.dtype, workers: CpuLoraSupervisor | SidecarWorkers,
                 max_tokens: int, max_in: int, max_out: int, max_segments: int) -> None:
        """The work area is `shm`'s "lora" file, and `host` its "host" file; `close` releases the claim. A job
        holds at most `max_tokens` rows of `max_in` features, `max_out` outputs and `max_segments` segments (a
        step's sequences times a projection's slices)."""
        assert host.path == shm.path("host"), "the host tier must be the claim's shared file"
        area_path = shm.path("lora")
        self._shm, self._host, self._dtype, self._workers = shm, host, dtype, workers
        self._page_elems = host.page_bytes // dtype.itemsize
        self._region = host.region.view(dtype)  # what the workers map: the host tier's file
        self.area = WorkArea.create(area_path, Shape(workers.count, max_tokens, max_in, max_out,
                                                     max_segments, max_pages=host.num_pages))
        self._jobs = self._local_shares = 0
        self._job_overhead_s = 0.0  # what a job costs the engine beyond the workers' arithmetic, as measured
        self._job_workers = 0       # how many workers the last job went to
        # Jobs (engine thread) and the watcher's restarts take turns on the workers and the work area.
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="cpu-lora-watcher", daemon=True)

    def start(self) -> None:
        """Have the workers serve the work area and the host tier; this process's own are waited for until
        each answers (its rates measured) pinned where it was put."""
        assert self._host.path is not None
        self._workers.serve(self.area, self._host.path, str(self._dtype).removeprefix("torch."))
        try:
            self._workers.wait_ready()
        except RuntimeError:
            self.close()
            raise
        self._watcher.start()

    @property
    def restarts(self) -> int:
        return self._workers.restarts

    def live(self) -> list[int]:
        """Workers ready for a job; a dead one is started again (ready a few seconds later)."""
        with self._lock:
            if not self._closing.is_set():
                self._workers.restart_exited()
            return [i for i in range(self._workers.count) if self._workers.ready(i)]

    def _watch(self) -> None:
        while not self._closing.wait(1.0):
            self.live()

    def run(self, x: torch.Tensor, out_features: int, segments: list[Segment], pages: list[int]) -> torch.Tensor:
        """The job's LoRA deltas [tokens, out_features], float32, filled in the segments' rows and columns
        only (a view of the work area: read before the next job). `x`: the rows, on the host."""
        with self._lock:
            return self._run(x, out_features, segments, pages)

    def _run(self, x: torch.Tensor, out_features: int, segments: list[Segment], pages: list[int]) -> torch.Tensor:
        tokens = x.shape[0]
        live = self.live()
        live = live[:workers_for(tokens, self._rate(max(s.rank for s in segments)), len(live))]
        self._job_workers = len(live)
        shares = [(0, 0)] * self._workers.count
        for index, share in zip(live, even_shares(tokens, len(live)) if live else []):
            shares[index] = share
        self.area.post(x, out_features, segments, shares, pages, self._page_elems)
        self._jobs += 1
        try:
            self.area.wait(JOB_TIMEOUT_S, alive=self._workers.running)
        except (TimeoutError, RuntimeError) as exc:
            log.warning("%s; computing their share here", exc)
        pending = self.area.pending()
        for index in pending:
            self._workers.kill(index)  # stuck: it must not write into a later job's rows
        left = [shares[index] for index in pending + self.area.failed()] if live else [(0, tokens)]
        self._local_shares += len(left)
        for share in left:  # the same arithmetic the workers run: the outputs do not change
            lora_delta(Job(self.area.x[:tokens, :x.shape[1]], out_features, segments, share, self.area.pages,
                           self._page_elems), self.area.y, self._region)
        return torch.from_numpy(self.area.y[:tokens, :out_features])

    def extra_step_s(self, tokens: int, packed: PackedAdapter) -> float | None:
        """About how much later a step ends with `tokens` rows of `packed` on the CPU LoRA workers: a job per
        projection it targets, each its share of the arithmetic at the rates measured at start plus what
        jobs have cost beyond that; None when no worker is ready."""
        live = len(self.live())
        if not live:
            return None
        jobs = [max(ranks) for _, ranks, _ in packed.parts if any(ranks)]
        return sum(self._job_overhead_s + self._arithmetic_s(tokens, rank, live) for rank in jobs)

    def observe_job(self, tokens: int, rank: int, seconds: float) -> None:
        """The last job, of `tokens` rows at `rank`, held the engine `seconds` (rows out, arithmetic, deltas in)."""
        rate = self._rate(rank)
        arithmetic = tokens / (rate * self._job_workers) if rate and self._job_workers else 0.0
        overhead = max(0.0, seconds - arithmetic)
        self._job_overhead_s = overhead if not self._job_overhead_s else 0.8 * self._job_overhead_s + 0.2 * overhead

    def _arithmetic_s(self, tokens: int, rank: int, live: int) -> float:
        rate = self._rate(rank)
        return tokens / (rate * workers_for(tokens, rate, live)) if rate else 0.0

    def _rate(self, rank: int) -> int:
        """Tokens per second one core computes at `rank`, as the slowest worker measured at start (0: none yet)."""
        bucket = next((i for i, r in enumerate(RATE_RANKS) if r >= rank), len(RATE_RANKS) - 1)
        rates = [int(self.area.control[w, RATES + bucket]) for w in range(self._workers.count)]
        return min((r for r in rates if r > 0), default=0)

    def stats(self) -> CpuLoraStats:
        count = self._workers.count
        return CpuLoraStats(count, sum(map(self._workers.ready, range(count))), self._jobs, self._local_shares,
                            self.restarts)

    def close(self) -> None:
        self._closing.set()
        if self._watcher.is_alive():
            self._watcher.join()
        self._workers.stop()
        self.area.close()
        self.area.path.unlink(missing_ok=True)
        self._shm.release()  # the host tier's file goes with the adapter tiers, right after (Engine.stop)


@dataclass(frozen=True)
class CpuLoraStep:
    """One step's CPU-assisted sequences: packed rows [first, last) of each, with its adapter's host copy."""
    pool: CpuLoraPool
    module_index: dict[LoRALinear, int]  # a projection's place in a PackedAdapter's parts
    rows: list[tuple[int, int, PackedAdapter]]

    def start(self, module: LoRALinear, x: torch.Tensor) -> Callable[[torch.Tensor], None] | None:
        """Take x[rows] to the host for `module`'s deltas, ahead of the projection's own kernels; -> the
        call that adds the deltas to its output once they are computed (None: nothing to add). On CUDA
        the copy is queued before the projection's matmul, so the host waits for the rows alone and the
        CPU LoRA workers compute while the GPU computes the base projection."""
        index = self.module_index.get(module)
        if index is None:
            return None
        segments, pages, shifts = self._segments(module, index)
        if not segments:
            return None
        rows = torch.cat([x[first:last] for first, last, _ in self.rows])
        started = time.perf_counter()
        copied = None
        if rows.is_cuda:
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            rows = host

        def finish(out: torch.Tensor) -> None:
            """out[rows, slices] += the deltas (the engine thread waits for the CPU LoRA workers here)."""
            if copied is not None:
                copied.synchronize()
            y = self.pool.run(rows, module.out_features, segments, pages)
            for s, shift in zip(segments, shifts):
                columns = slice(s.out_offset, s.out_offset + s.out_size)
                out[s.first + shift:s.last + shift, columns] += y[s.first:s.last, columns].to(out.device, out.dtype)
            self.pool.observe_job(rows.shape[0], max(s.rank for s in segments), time.perf_counter() - started)
        return finish

    def _segments(self, module: LoRALinear, index: int) -> tuple[list[Segment], list[int], list[int]]:
        """The job's segments for `module` (its slices of each row range's adapter), its page table, and
        each segment's shift from job tokens to the step's rows."""
        segments, pages, shifts, tables, token = [], [], [], {}, 0
        for first, last, packed in self.rows:
            offset, ranks, scalings = packed.parts[index]
            if any(ranks):
                if id(packed) not in tables:
                    tables[id(packed)] = len(pages)
                    pages.extend(packed.pages)
                a_rel, b_rel, _ = packed_layout(module.in_features, module.out_sizes, ranks)
                for s, rank in enumerate(ranks):
                    if rank:
                        segments.append(Segment(token, token + last - first, offset + a_rel[s], offset + b_rel[s],
                                                rank, module.out_offsets[s], module.out_sizes[s], scalings[s],
                                                tables[id(packed)]))
                        shifts.append(first - token)
            token += last - first
        return segments, pages, shifts
