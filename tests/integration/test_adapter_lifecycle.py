"""An adapter's lifecycle through the real processes: DELETE drains (new requests get 404 while a stream
in flight runs to its end, then the worker no longer holds it), and an operator's pin through the admin
API (the worker loads it with no request and reports it pinned on the GPU, until the pin is lifted)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable

import pytest
import requests

from tessera.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.integration

BASE = "tessera-demo-llama"


def _auth(system) -> dict[str, str]:
    return {"Authorization": f"Bearer {system.admin_key}"}


def _register_variant(system, name: str, alpha: float) -> dict:
    """A genuine variant of demo-r16 (its own alpha, so its own digest) registered as `name`."""
    source = requests.get(f"{system.admin_base}/adapters/demo-r16", headers=_auth(system), timeout=10).json()
    upload = system.home / "uploads" / name
    shutil.rmtree(upload, ignore_errors=True)
    shutil.copytree(source["storage_path"], upload)
    config = json.loads((upload / "adapter_config.json").read_text())
    config["lora_alpha"] = alpha
    (upload / "adapter_config.json").write_text(json.dumps(config))
    created = requests.post(f"{system.admin_base}/adapters", headers=_auth(system), timeout=60,
                            json={"name": name, "base_model": BASE, "path": str(upload)})
    assert created.status_code == 201, created.text
    return created.json()


def _eventually(what: str, check: Callable[[], object], timeout_s: float = 30.0) -> object:
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)
    return result


def _worker_state(system) -> worker_pb2.WorkerState:
    with system.internal_channel(system.worker_grpc) as channel:
        stream = worker_pb2_grpc.WorkerServiceStub(channel).WatchState(worker_pb2.WatchStateRequest(interval_ms=50),
                                                                       timeout=10)
        state = next(stream)
        stream.cancel()
        return state


def _held(state: worker_pb2.WorkerState) -> set[str]:
    return set(state.gpu_adapters) | set(state.host_adapters) | set(state.loading_adapters)


def _complete(system, model: str) -> requests.Response:
    return requests.post(f"{system.http_base}/completions", timeout=60,
                         json={"model": model, "prompt": "def f():", "max_tokens": 2})


def _placements(system, adapter: str) -> list[dict]:
    return requests.get(f"{system.admin_base}/placements", params={"adapter": adapter}, headers=_auth(system),
                        timeout=10).json()["placements"]


def test_delete_refuses_new_requests_at_once_lets_the_stream_in_flight_finish_then_the_worker_drops_it(system):
    _register_variant(system, "drained", alpha=20)
    assert _eventually("the gateway serves it", lambda: _complete(system, "drained").status_code == 200)
    stream = requests.post(f"{system.http_base}/completions", stream=True, timeout=120, json={
        "model": "drained", "prompt": "Count forever:", "max_tokens": 400, "stream": True})
    assert stream.status_code == 200, stream.text
    events = stream.iter_lines()
    first = next(line for line in events if line.startswith(b"data: "))
    assert json.loads(first[len(b"data: "):])["choices"][0]["text"] is not None
    assert "drained" in _held(_worker_state(system))

    deleted = requests.delete(f"{system.admin_base}/adapters/drained", headers=_auth(system), timeout=10)
    assert deleted.status_code == 200, deleted.text
    # The registry announces the deletion to the gateway as it commits: no waiting for a refresh.
    refused = _eventually("new requests are refused", lambda: [
        r for r in [_complete(system, "drained")] if r.status_code == 404], timeout_s=5.0)
    assert "model 'drained' does not exist" in refused[0].json()["error"]["message"]

    rest = [json.loads(line[len(b"data: "):]) for line in events
            if line.startswith(b"data: ") and line != b"data: [DONE]"]
    finishes = [c["choices"][0]["finish_reason"] for c in rest if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes in (["length"], ["stop"]), rest[-3:]  # the stream in flight ended normally
    _eventually("the worker no longer holds it", lambda: "drained" not in _held(_worker_state(system)))
    assert _placements(system, "drained") == []
    assert _complete(system, "demo-r16").status_code == 200  # its neighbours serve on


def test_a_pin_through_the_admin_api_is_loaded_without_a_request_and_reported_until_lifted(system):
    _register_variant(system, "pinned", alpha=24)
    worker = requests.get(f"{system.admin_base}/workers", params={"healthy_only": "true"}, headers=_auth(system),
                          timeout=10).json()["workers"][0]["worker_id"]
    url = f"{system.admin_base}/adapters/pinned/placements"
    assert requests.post(url, headers=_auth(system), timeout=10, json={"workers": ["ghost"], "pin": True}).status_code == 404
    ordered = requests.post(url, headers=_auth(system), timeout=10, json={"workers": [worker], "pin": True})
    assert ordered.status_code == 200, ordered.text

    reported = _eventually("the worker reports it pinned on the GPU", lambda: [
        p for p in _placements(system, "pinned") if (p["tier"], p["loading"], p["pinned"]) == ("gpu", False, True)])
    assert [p["worker_id"] for p in reported] == [worker]
    assert "pinned" in _worker_state(system).gpu_adapters  # no request ever asked for it

    lifted = requests.delete(f"{url}/{worker}", headers=_auth(system), timeout=10)
    assert lifted.status_code == 200, lifted.text
    _eventually("the pin is lifted", lambda: [p for p in _placements(system, "pinned") if not p["pinned"]])
    assert requests.delete(f"{system.admin_base}/adapters/pinned", headers=_auth(system), timeout=10).status_code == 200
    _eventually("the worker drops it", lambda: "pinned" not in _held(_worker_state(system)))
