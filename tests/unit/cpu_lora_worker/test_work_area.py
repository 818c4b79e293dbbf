"""CPU LoRA worker processes over the shared-memory work area: their deltas equal float32 torch for
several adapters, ranks and slices in one job split between workers; they run pinned to the cores
they were given (checked from /proc); a failed job fails alone; a dead worker is named, not waited
for forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.cpu_lora.numa import allowed_cpus, format_cpulist
from services.common.cpu_lora.shm import PID, RATE_RANKS, RATES, Segment, Shape, WorkArea, even_shares

IN, OUT = 48, 40
PAGE = 100  # elements: blocks straddle pages
START_S = 60.0


class Region:
    """A weights file in pages of PAGE elements: adapters' A [rank, IN] and Bt [rank, size] blocks laid
    one after another in one packed copy, whose pages sit in the file in a scrambled order (as an
    adapter's host pages may), listed by `pages`."""

    def __init__(self, path: Path, dtype: torch.dtype) -> None:
        self.path, self.dtype, self.copy = path, dtype, torch.empty(0, dtype=dtype)
        self.pages: list[int] = []

    def add(self, rank: int, size: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        a, bt = torch.randn(rank, IN).to(self.dtype), torch.randn(rank, size).to(self.dtype)
        a_offset = self.copy.numel()
        self.copy = torch.cat([self.copy, a.flatten(), bt.flatten()])
        count = -(-self.copy.numel() // PAGE)
        self.pages = torch.randperm(count, generator=torch.Generator().manual_seed(count)).tolist()
        region = torch.zeros(count * PAGE, dtype=self.dtype)
        padded = torch.cat([self.copy, torch.zeros(count * PAGE - self.copy.numel(), dtype=self.dtype)])
        for virtual, page in enumerate(self.pages):
            region[page * PAGE:(page + 1) * PAGE] = padded[virtual * PAGE:(virtual + 1) * PAGE]
        self.path.write_bytes(region.view(torch.uint8).numpy().tobytes())
        return a_offset, a_offset + a.numel(), a.float(), bt.float()


def worker_command(area: Path, weights: Region, index: int, cores: list[int]) -> list[str]:
    return [sys.executable, "-m", "cpu_lora_worker", "--work-area", str(area), "--weights", str(weights.path),
            "--index", str(index), "--cores", format_cpulist(cores), "--dtype", str(weights.dtype).removeprefix("torch.")]


def start_worker(area: Path, weights: Region, index: int, cores: list[int]) -> subprocess.Popen:
    return subprocess.Popen(worker_command(area, weights, index, cores), cwd=Path(__file__).resolve().parents[3])


def wait_started(area: WorkArea, workers: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + START_S
    while not all(area.control[w, PID] == p.pid for w, p in enumerate(workers)):
        assert all(p.poll() is None for p in workers), "a CPU LoRA worker exited at start"
        assert time.monotonic() < deadline, "CPU LoRA workers did not start"
        time.sleep(0.05)


@pytest.fixture
def pair(tmp_path):
    """Two CPU LoRA workers over one work area, each pinned to one allowed core (both to the same
    one on a one-core machine), with a float32 weights region to fill."""
    weights = Region(tmp_path / "weights", torch.float32)
    area = WorkArea.create(tmp_path / "area", Shape(workers=2, max_tokens=64, max_in=IN, max_out=3 * OUT,
                                                    max_segments=8, max_pages=64))
    cores = sorted(os.sched_getaffinity(0))
    yield area, weights, cores
    area.close()


def run(area: WorkArea, weights: Region, x: torch.Tensor, out_features: int, segments: list[Segment]
        ) -> torch.Tensor:
    area.post(x.numpy(), out_features, segments, even_shares(x.shape[0], area.shape.workers), weights.pages, PAGE)
    area.wait(timeout_s=30)
    return torch.from_numpy(area.y[:x.shape[0], :out_features].copy())


def stop(workers: list[subprocess.Popen]) -> None:
    for p in workers:
        p.terminate()
    for p in workers:
        p.wait(10)


def test_deltas_equal_torch_for_adapters_ranks_and_slices_split_between_workers(pair):
    area, weights, cores = pair
    # Two adapters in one job: tokens 0-22 a rank-8 adapter on three slices (a fused q,k,v), 23-36
    # a rank-16 one on the middle slice only.
    sizes = (OUT, OUT // 2, OUT // 2)
    first = [weights.add(8, size) for size in sizes]
    second = weights.add(16, sizes[1])
    workers = [start_worker(area.path, weights, w, [cores[w % len(cores)]]) for w in range(2)]
    try:
        wait_started(area, workers)
        assert all(area.control[w, RATES + i] > 0 for w in range(2) for i in range(len(RATE_RANKS)))
        for w, p in enumerate(workers):  # pinned where the launcher put them
            assert allowed_cpus(p.pid) == [cores[w % len(cores)]]
        x = torch.randn(37, IN)
        starts = (0, sizes[0], sizes[0] + sizes[1])
        segments = [Segment(0, 23, a_off, bt_off, 8, start, size, 0.5)
                    for (a_off, bt_off, _, _), start, size in zip(first, starts, sizes)]
        segments.append(Segment(23, 37, second[0], second[1], 16, starts[1], sizes[1], 2.0))
        expected = torch.zeros(37, sum(sizes))
        for (_, _, a, bt), start, size in zip(first, starts, sizes):
            expected[:23, start:start + size] = 0.5 * (x[:23] @ a.t()) @ bt
        expected[23:, starts[1]:starts[1] + sizes[1]] = 2.0 * (x[23:] @ second[2].t()) @ second[3]
        for _ in range(3):  # jobs back to back, as a prefill's layers come
            torch.testing.assert_close(run(area, weights, x, sum(sizes), segments), expected, rtol=1e-5, atol=1e-5)
        # A job with a block outside the region fails that job, and the next one is served.
        broken = [Segment(0, 37, 10**9, 10**9, 8, 0, OUT, 1.0)]
        with pytest.raises(RuntimeError, match="failed the job"):
            run(area, weights, x, OUT, broken)
        torch.testing.assert_close(run(area, weights, x, sum(sizes), segments), expected, rtol=1e-5, atol=1e-5)
    finally:
        stop(workers)


def test_bfloat16_weights_are_read_as_stored(tmp_path):
    weights = Region(tmp_path / "weights", torch.bfloat16)
    a_off, bt_off, a, bt = weights.add(32, OUT)
    area = WorkArea.create(tmp_path / "area", Shape(1, 16, IN, OUT, 2, 64))
    workers = [start_worker(area.path, weights, 0, sorted(os.sched_getaffinity(0))[:1])]
    try:
        wait_started(area, workers)
        x = torch.randn(16, IN)
        got = run(area, weights, x, OUT, [Segment(0, 16, a_off, bt_off, 32, 0, OUT, 0.25)])
        torch.testing.assert_close(got, 0.25 * (x @ a.t()) @ bt, rtol=1e-5, atol=1e-4)
    finally:
        stop(workers)
        area.close()


def test_a_dead_worker_is_named_and_the_others_answer(pair):
    area, weights, cores = pair
    a_off, bt_off, a, bt = weights.add(8, OUT)
    workers = [start_worker(area.path, weights, w, cores[:1]) for w in range(2)]
    try:
        wait_started(area, workers)
        workers[1].send_signal(signal.SIGKILL)
        workers[1].wait(10)
        x = torch.randn(8, IN)
        area.post(x.numpy(), OUT, [Segment(0, 8, a_off, bt_off, 8, 0, OUT, 1.0)], even_shares(8, 2),
                  weights.pages, PAGE)
        with pytest.raises(TimeoutError, match=rf"workers \[1\] \(pids \[{workers[1].pid}\]\)"):
            area.wait(timeout_s=1.0)
        assert area.pending() == [1]  # worker 0 answered its half
        torch.testing.assert_close(torch.from_numpy(area.y[:4, :OUT].copy()), (x[:4] @ a.t()) @ bt,
                                   rtol=1e-5, atol=1e-5)
    finally:
        stop(workers)


def test_a_work_area_is_private_and_checked_when_opened(tmp_path):
    area = WorkArea.create(tmp_path / "area", Shape(2, 4, 8, 8, 1, 4))
    assert (tmp_path / "area").stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        WorkArea.create(tmp_path / "area", Shape(2, 4, 8, 8, 1, 4))
    other = WorkArea.open(tmp_path / "area")
    assert other.shape == area.shape
    other.close()
    (tmp_path / "junk").write_bytes(np.zeros(64, dtype=np.int64).tobytes())
    with pytest.raises(ValueError, match="not a Tessera LoRA work area"):
        WorkArea.open(tmp_path / "junk")
    with pytest.raises(ValueError, match="exceeds the work area"):
        area.post(np.zeros((5, 8), dtype=np.float32), 8, [], even_shares(5, 2), [], 4)
    area.close()


def test_a_worker_whose_parent_died_exits(pair):
    """A GPU worker killed outright cannot stop its CPU LoRA workers: each notices it was orphaned."""
    area, weights, cores = pair
    weights.add(4, OUT)
    parent = ("import os, subprocess, sys; print(subprocess.Popen([*sys.argv[1:], '--parent', str(os.getpid())], "
              "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")  # starts one, and is gone at once
    started = subprocess.run([sys.executable, "-c", parent, *worker_command(area.path, weights, 0, cores[:1])],
                             capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[3])
    child = int(started.stdout)
    deadline = time.monotonic() + START_S
    while Path(f"/proc/{child}").exists() and _state(child) != "Z":
        assert time.monotonic() < deadline, "the orphaned CPU LoRA worker did not exit"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"
