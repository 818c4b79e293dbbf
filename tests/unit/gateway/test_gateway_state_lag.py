"""A worker whose state stream is open but late (the gateway's own loop or the worker fell behind a
burst: 2,000 streams at once on two cores left 1.2 s between two states) still serves the requests
that arrive meanwhile; only a stream silent past the wait leaves a request no worker, a 503 with
Retry-After. Through the real gateway to a fake worker that stops pushing for a while."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import requests

from tests.unit.gateway.gateway_fakes import BASE, GatewayEnv

COMPLETION = {"model": BASE, "prompt": "hello there", "max_tokens": 3, "stream": True}


@pytest.fixture
def env() -> Iterator[GatewayEnv]:
    env = GatewayEnv()
    assert requests.post(f"{env.http_base}/v1/completions", json=COMPLETION, timeout=30).ok  # the stream is open
    yield env
    env.close()


def test_a_request_meeting_a_late_state_waits_for_the_next_one_and_is_served(env: GatewayEnv) -> None:
    stale_s = env.config.gateway.state_stale_s
    silence_s = stale_s + 0.6
    env.workers[0].silent_until = time.monotonic() + silence_s
    time.sleep(stale_s + 0.2)  # the last state the gateway read is now stale

    started = time.monotonic()
    answer = requests.post(f"{env.http_base}/v1/completions", json=COMPLETION, timeout=30)
    waited_s = time.monotonic() - started

    assert answer.status_code == 200, answer.text
    assert answer.text.endswith("data: [DONE]\n\n")
    assert waited_s < stale_s, "it waited for the next state, which came within the wait"


def test_a_state_stream_silent_past_the_wait_is_a_503_with_retry_after_not_a_hang(env: GatewayEnv) -> None:
    stale_s = env.config.gateway.state_stale_s
    env.workers[0].silent_until = time.monotonic() + 10 * stale_s
    time.sleep(stale_s + 0.2)

    started = time.monotonic()
    answer = requests.post(f"{env.http_base}/v1/completions", json=COMPLETION, timeout=30)
    waited_s = time.monotonic() - started

    assert answer.status_code == 503
    assert int(answer.headers["Retry-After"]) >= 1
    assert "none reporting its state" in answer.json()["error"]["message"]
    assert answer.headers["Content-Length"] == str(len(answer.content)), "a whole JSON error, not a chunked one"
    assert stale_s * 0.9 <= waited_s < 2 * stale_s, "refused after one wait for the next state"
