"""A stored adapter changed on disk after registration, through the real processes: its requests fail
at once with a clear "checksum mismatch" that says how to mend it, the requests beside them are served as
before, and registering it again from good files serves it at once."""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

pytestmark = pytest.mark.integration

BASE = "tessera-demo-llama"


def _auth(system) -> dict[str, str]:
    return {"Authorization": f"Bearer {system.admin_key}"}


def _set_alpha(config_path: Path, alpha: float) -> None:
    config = json.loads(config_path.read_text())
    config["lora_alpha"] = alpha
    config_path.write_text(json.dumps(config))


def _wait_listed(system, model: str, timeout_s: float = 30.0, listed: bool = True) -> None:
    """Until the gateway's adapter metadata (refreshed every 0.5 s here) knows `model` (or, `listed` False,
    no longer knows it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        entries = requests.get(f"{system.http_base}/models", timeout=10).json()["data"]
        if any(entry["id"] == model for entry in entries) == listed:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the gateway {'does not list' if listed else 'still lists'} {model} after {timeout_s}s")


def _complete(system, model: str, max_tokens: int) -> tuple[requests.Response, float]:
    started = time.monotonic()
    reply = requests.post(f"{system.http_base}/completions", timeout=60,
                          json={"model": model, "prompt": "def handler(request):", "max_tokens": max_tokens})
    return reply, time.monotonic() - started


def test_an_adapter_whose_stored_alpha_changed_fails_at_once_and_others_serve_on(system):
    source = requests.get(f"{system.admin_base}/adapters/demo-r16", headers=_auth(system), timeout=10).json()
    upload = system.home / "uploads" / "alpha-tampered"
    shutil.rmtree(upload, ignore_errors=True)
    shutil.copytree(source["storage_path"], upload)
    _set_alpha(upload / "adapter_config.json", 24)  # a genuine variant of demo-r16: its own stored copy
    created = requests.post(f"{system.admin_base}/adapters", headers=_auth(system), timeout=60,
                            json={"name": "alpha-tampered", "base_model": BASE, "path": str(upload)})
    assert created.status_code == 201, created.text
    stored = Path(created.json()["storage_path"])
    assert stored != Path(source["storage_path"])
    _set_alpha(stored / "adapter_config.json", 2400)  # on disk, after registration, before any worker loaded it
    _wait_listed(system, "alpha-tampered")

    with ThreadPoolExecutor(max_workers=5) as pool:
        good = [pool.submit(_complete, system, model, 24) for model in ("demo-r16", BASE, "demo-r16", BASE)]
        tampered, elapsed = pool.submit(_complete, system, "alpha-tampered", 24).result()
        served = [future.result()[0] for future in good]

    assert tampered.status_code == 409, tampered.text
    message = tampered.json()["error"]["message"]
    assert "adapter alpha-tampered could not be loaded: checksum mismatch" in message
    assert "Traceback" not in message and str(system.home) not in message
    assert elapsed < 5.0  # refused at admission, not after a timeout
    assert [reply.status_code for reply in served] == [200] * 4, [reply.text for reply in served]
    again, _ = _complete(system, "demo-r16", 4)
    assert again.status_code == 200, again.text

    # Registered again from the good files (DELETE, then POST, as the error says): the registry replaces the
    # stored copy, and the worker reads it at once under the newer registration, not after its backoff.
    assert "DELETE /admin/v1/adapters/alpha-tampered, then POST /admin/v1/adapters" in message
    assert requests.delete(f"{system.admin_base}/adapters/alpha-tampered", headers=_auth(system),
                           timeout=10).status_code == 200
    _wait_listed(system, "alpha-tampered", listed=False)
    recreated = requests.post(f"{system.admin_base}/adapters", headers=_auth(system), timeout=60,
                              json={"name": "alpha-tampered", "base_model": BASE, "path": str(upload)})
    assert recreated.status_code == 201 and Path(recreated.json()["storage_path"]) == stored, recreated.text
    _wait_listed(system, "alpha-tampered")
    mended, _ = _complete(system, "alpha-tampered", 4)
    assert mended.status_code == 200, mended.text
    assert requests.delete(f"{system.admin_base}/adapters/alpha-tampered", headers=_auth(system),
                           timeout=10).status_code == 200
