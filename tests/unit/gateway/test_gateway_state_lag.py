"""A worker whose state stream is open but late — its process paused (SIGSTOP, a long GC), or the
gateway's own loop behind a burst (2,000 streams at once on two cores left 1.2 s between two states) —
still serves the requests that arrive meanwhile: they wait for its next state as long as the registry
lists the worker. A worker that is really gone (its stream ended), or that the registry stops listing,
is a prompt 503 with Retry-After, logged with its reason. Through the real gateway to fake workers."""

from __future__ import annotations

import logging
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


def _complete(env: GatewayEnv) -> tuple[requests.Response, float]:
    started = time.monotonic()
    answer = requests.post(f"{env.http_base}/v1/completions", json=COMPLETION, timeout=60)
    return answer, time.monotonic() - started


def _assert_logged_503(answer: requests.Response, caplog: pytest.LogCaptureFixture, reason: str) -> None:
    assert answer.status_code == 503, answer.text
    assert int(answer.headers["Retry-After"]) >= 1
    assert reason in answer.json()["error"]["message"]
    assert answer.headers["Content-Length"] == str(len(answer.content)), "a whole JSON error, not a chunked one"
    logged = [r for r in caplog.records if r.name == "gateway.core" and "unavailable (503)" in r.getMessage()]
    assert len(logged) == 1 and reason in logged[0].getMessage()


def test_a_request_meeting_a_late_state_waits_for_the_next_one_and_is_served(env: GatewayEnv) -> None:
    stale_s = env.config.gateway.state_stale_s
    env.workers[0].silent_until = time.monotonic() + stale_s + 0.6
    time.sleep(stale_s + 0.2)  # the last state the gateway read is now stale

    answer, waited_s = _complete(env)

    assert answer.status_code == 200, answer.text
    assert answer.text.endswith("data: [DONE]\n\n")
    assert waited_s < stale_s, "it waited for the next state, which came within the wait"


def test_a_worker_silent_for_several_stale_windows_is_waited_for_not_refused(env: GatewayEnv) -> None:
    """The SIGSTOP reproduction: requests arriving during a 3-stale-window pause all complete."""
    stale_s = env.config.gateway.state_stale_s
    resumes_at = time.monotonic() + 3 * stale_s
    env.workers[0].silent_until = resumes_at
    time.sleep(stale_s + 0.2)

    answer, _ = _complete(env)

    assert answer.status_code == 200, answer.text
    assert time.monotonic() >= resumes_at - 0.1, "served once the worker spoke again"


def test_a_worker_that_is_gone_is_a_prompt_503_logged_with_its_reason(env: GatewayEnv,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway")
    env.stop_worker(0)  # its streams end; the registry still lists it until its heartbeat times out

    answer, waited_s = _complete(env)

    _assert_logged_503(answer, caplog, "no healthy worker serves base model")
    assert waited_s < env.config.gateway.state_stale_s, "not waited for: its stream ended"


def test_a_silent_worker_the_registry_drops_is_a_503(env: GatewayEnv, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway")
    stale_s = env.config.gateway.state_stale_s
    env.workers[0].silent_until = time.monotonic() + 60
    time.sleep(stale_s + 0.2)
    env.loop.loop.call_later(2 * stale_s, env.registry.workers.clear)  # its heartbeats stopped: unhealthy
    env.loop.loop.call_later(2 * stale_s + 0.1, lambda: env.loop.loop.create_task(env.gateway.cache.refresh()))

    answer, waited_s = _complete(env)

    _assert_logged_503(answer, caplog, f"no live worker serves base model '{BASE}'")
    assert 2 * stale_s <= waited_s < 4 * stale_s, "waited while the registry listed it, no longer"


def test_a_worker_silent_past_the_longest_wait_is_a_503(env: GatewayEnv, caplog: pytest.LogCaptureFixture) -> None:
    """The registry listing it for ever (itself down, say) does not hold a request for ever."""
    caplog.set_level(logging.INFO, logger="gateway")
    stale_s = env.config.gateway.state_stale_s
    env.config.gateway.late_worker_wait_s = 2 * stale_s
    env.workers[0].silent_until = time.monotonic() + 60
    time.sleep(stale_s + 0.2)

    answer, waited_s = _complete(env)

    _assert_logged_503(answer, caplog, "none reporting its state")
    assert 2 * stale_s <= waited_s < 4 * stale_s
