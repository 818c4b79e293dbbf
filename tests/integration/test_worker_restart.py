"""Killing the worker mid-stream: that stream ends with an error, the launcher restarts
the worker, and the next request succeeds. (Runs last: file order.)"""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

pytestmark = pytest.mark.integration


def test_worker_killed_mid_stream_errors_then_recovers(system):
    client = openai.OpenAI(base_url=system.http_base, api_key="unused", max_retries=0, timeout=120)
    old_pid = system.child_pid("worker")
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
    assert system.child_pid("worker") != old_pid, "launcher did not restart the worker"
    system.wait_healthy(system.worker_grpc, "worker")
    system.wait_worker_registered()
    reply = client.chat.completions.create(model="demo-r8", messages=[{"role": "user", "content": "again"}],
                                           max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
