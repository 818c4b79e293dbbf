"""A worker paused, then killed: requests arriving while it is paused wait and complete (never a 503
while the registry still sees it); killed mid-stream, that stream ends with an error, the launcher
restarts the worker, the new worker reclaims the dead one's shared-memory files (its CPU LoRA workers
exit with it), and the next request succeeds. (Runs last: file order.)"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import openai
import pytest
import requests

pytestmark = pytest.mark.integration


def _complete(system, prompt: str) -> int:
    answer = requests.post(f"{system.http_base}/completions", timeout=120,
                           json={"model": "demo-r8", "prompt": prompt, "max_tokens": 4, "temperature": 0})
    return answer.status_code


def test_requests_arriving_while_the_worker_is_paused_wait_and_complete(system):
    """The reproduction of a 503 with a live worker: SIGSTOP for 3 s, 12 requests arriving meanwhile."""
    pid = system.child_pid("worker")
    assert _complete(system, "warm") == 200
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        os.kill(pid, signal.SIGSTOP)
        try:
            answers = []
            for i in range(12):
                answers.append(pool.submit(_complete, system, f"request {i} during the pause"))
                time.sleep(0.25)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert [a.result() for a in answers] == [200] * 12


def _children(pid: int) -> set[int]:
    """Its child processes, whichever of its threads started them."""
    return {int(p) for task in Path(f"/proc/{pid}/task").iterdir() for p in (task / "children").read_text().split()}


def _running(pid: int) -> bool:
    """Alive and not a zombie (a reparented child may wait a moment to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _shm_files(system, pid: int) -> set[Path]:
    return set(system.home.glob(f"tessera-{pid}-*"))  # the shm directory (worker.cpu_lora_shm_dir)


def test_worker_killed_mid_stream_errors_then_recovers_and_its_files_are_reclaimed(system):
    client = openai.OpenAI(base_url=system.http_base, api_key="unused", max_retries=0, timeout=120)
    old_pid = system.child_pid("worker")
    old_files, cpu_lora_workers = _shm_files(system, old_pid), _children(old_pid)
    assert len(old_files) == 3, "a claim, the host tier and the CPU LoRA work area"
    assert cpu_lora_workers, "the worker runs CPU LoRA workers"
    stream = client.chat.completions.create(
        model="demo-r8", messages=[{"role": "user", "content": "Count forever."}],
        max_tokens=1800, temperature=0, stream=True)
    received = 0
    with pytest.raises(openai.APIError):
        for chunk in stream:
            received += 1
            if received == 2:
                os.kill(old_pid, signal.SIGKILL)
    assert received >= 2

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and system.child_pid("worker") == old_pid:
        time.sleep(0.2)
    new_pid = system.child_pid("worker")
    assert new_pid != old_pid, "launcher did not restart the worker"
    system.wait_healthy(system.worker_grpc, "worker")
    system.wait_worker_registered()
    reply = client.chat.completions.create(model="demo-r8", messages=[{"role": "user", "content": "again"}],
                                           max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert not any(f.exists() for f in old_files), "the restarted worker reclaimed the dead one's files"
    assert len(_shm_files(system, new_pid)) == 3
    assert not any(map(_running, cpu_lora_workers)), "its CPU LoRA workers exited"
