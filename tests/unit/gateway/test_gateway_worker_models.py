"""Each worker prices itself: the gateway prices a worker with the performance model the worker reports
in its state stream, under its kind, and routes no worker whose kind has no model; it never prices one
with another kind's model."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator

import pytest
import requests

from policy.perf_model import PerfModel, perf_model_path

from .gateway_fakes import BASE, PERF_MODEL, FakeWorker, GatewayEnv

NEW_KIND = "nvidia-b300-tiny-llama"  # committed nowhere


@pytest.fixture
def env() -> Iterator[GatewayEnv]:
    env = GatewayEnv(workers=0)
    yield env
    env.close()


def _complete(env: GatewayEnv) -> requests.Response:
    return requests.post(f"{env.http_base}/v1/completions", timeout=20,
                         json={"model": BASE, "prompt": "hi", "max_tokens": 2})


def test_a_worker_of_a_new_kind_is_routed_with_the_model_it_reports(env: GatewayEnv, caplog) -> None:
    caplog.set_level(logging.INFO, logger="gateway.state_feed")
    own = PerfModel.load(perf_model_path(PERF_MODEL))
    own = dataclasses.replace(own, kind=NEW_KIND, device="NVIDIA B300", source="its own profile at start")
    worker = env.add_worker(FakeWorker(name="new", kind=NEW_KIND, perf_model_spec=json.dumps(own.to_json())))
    env.refresh()
    assert _complete(env).status_code == 200 and len(worker.requests) == 1  # priced: by its model alone
    assert f"prices itself with its model of {NEW_KIND} (its own profile at start)" in caplog.text


def test_a_worker_whose_kind_has_no_model_is_not_priced_with_another_kinds(env: GatewayEnv) -> None:
    silent = env.add_worker(FakeWorker(name="no-model", kind=NEW_KIND))
    env.refresh()
    response = _complete(env)
    assert response.status_code == 503 and "none reporting its state" in response.json()["error"]["message"]
    known = env.add_worker(FakeWorker(name="known"))  # a committed kind: routed
    env.refresh()
    assert all(_complete(env).status_code == 200 for _ in range(3))
    assert len(known.requests) == 3 and not silent.requests


def test_a_model_reported_for_another_kind_is_refused(env: GatewayEnv) -> None:
    other = PerfModel.load(perf_model_path(PERF_MODEL))  # its JSON says cpu-tessera-demo-llama
    worker = env.add_worker(FakeWorker(name="liar", kind=NEW_KIND, perf_model_spec=json.dumps(other.to_json())))
    env.refresh()
    assert _complete(env).status_code == 503 and not worker.requests
