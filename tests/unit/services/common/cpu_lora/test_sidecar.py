"""services.common.cpu_lora.sidecar, both ends of the handshake in one process: the sidecar starts the workers
the GPU worker's manifest names and marks them alive; a worker the GPU worker finds stuck is killed when it
asks, before its ask returns, and started again. (A sidecar in its own process beside a running engine:
tests/unit/gpu_worker/test_cpu_assist.py.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from services.common.cpu_lora.shm import KILL, KILLED, PID, Shape, WorkArea
from services.common.cpu_lora.sidecar import Sidecar, SidecarWorkers

START_S = 120.0  # a worker imports torch and measures its rates before it answers


def step_until(sidecar: Sidecar, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + START_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        sidecar.step()
        time.sleep(0.05)


def test_a_worker_the_gpu_worker_finds_stuck_is_killed_by_the_sidecar_then_started_again(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    weights.write_bytes(bytes(4096))
    area = WorkArea.create(tmp_path / "area", Shape(workers=1, max_tokens=8, max_in=8, max_out=8, max_segments=1,
                                                    max_pages=1))
    gpu_side = SidecarWorkers(1)
    gpu_side.serve(area, weights, "float32")
    sidecar = Sidecar(tmp_path, cores_each=1)
    try:
        step_until(sidecar, lambda: gpu_side.ready(0))
        stuck = int(area.control[0, PID])
        asking = threading.Thread(target=gpu_side.kill, args=(0,))
        asking.start()
        step_until(sidecar, lambda: not asking.is_alive())
        assert int(area.control[0, KILL]) == int(area.control[0, KILLED]) == 1
        assert not Path(f"/proc/{stuck}").exists()  # gone before the ask returned
        assert not gpu_side.ready(0)  # until its replacement answers
        step_until(sidecar, lambda: gpu_side.ready(0))
        assert int(area.control[0, PID]) not in (0, stuck)
    finally:
        sidecar.stop()
        area.close()
