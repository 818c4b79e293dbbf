"""Bad input through the real processes: a clear error each time, and the system stays up."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import requests

pytestmark = pytest.mark.integration

BASE = "tessera-demo-llama"


def post_chat(system, body, raw: str | None = None) -> requests.Response:
    return requests.post(f"{system.http_base}/chat/completions", timeout=60,
                         data=raw if raw is not None else json.dumps(body),
                         headers={"Content-Type": "application/json"})


def error_message(reply: requests.Response) -> str:
    return reply.json()["error"]["message"]


@pytest.mark.parametrize("body,raw,status,needle", [
    (None, "{not json", 400, "json"),
    ({"model": "no-such-adapter", "messages": [{"role": "user", "content": "hi"}]}, None, 404, "no-such-adapter"),
    ({"model": BASE, "messages": []}, None, 400, "messages"),
    ({"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, None, 400, "max_tokens"),
    ({"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, None, 400, "max_tokens"),
    ({"model": BASE, "messages": [{"role": "user", "content": "hi " * 3000}], "max_tokens": 10}, None, 400, "context"),
])
def test_bad_requests_get_clear_errors(system, body, raw, status, needle):
    reply = post_chat(system, body, raw)
    assert reply.status_code == status, reply.text
    assert needle.lower() in error_message(reply).lower()
    ok = post_chat(system, {"model": BASE, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def _adapter_copy(system, name: str) -> Path:
    """A PEFT directory inside the registry's import root, copied from a demo adapter."""
    auth = {"Authorization": f"Bearer {system.admin_key}"}
    source = requests.get(f"{system.admin_base}/adapters/demo-r16", headers=auth, timeout=10).json()["storage_path"]
    target = system.home / "uploads" / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    return target


def _register(system, name: str, path: Path, key: str | None = "valid") -> requests.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {system.admin_key if key == 'valid' else key}"}
    return requests.post(f"{system.admin_base}/adapters", headers=headers, timeout=60,
                         json={"name": name, "base_model": BASE, "path": str(path)})


def _rank_mismatch(path: Path) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config["r"] = 32
    (path / "adapter_config.json").write_text(json.dumps(config))


def _target_mismatch(path: Path) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
    (path / "adapter_config.json").write_text(json.dumps(config))


def _truncate(path: Path) -> None:
    data = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])


def _corrupt_header(path: Path) -> None:
    data = bytearray((path / "adapter_model.safetensors").read_bytes())
    data[8:24] = b"#" * 16
    (path / "adapter_model.safetensors").write_bytes(bytes(data))


def _pickle_instead(path: Path) -> None:
    (path / "adapter_model.safetensors").unlink()
    marker = path / "UNPICKLED"
    # Unpickling this would create the marker file; the registry must never do it.
    payload = (b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    (path / "adapter_model.bin").write_bytes(payload)


@pytest.mark.parametrize("breaker,needle", [
    (_rank_mismatch, "rank"),
    (_target_mismatch, "down_proj"),
    (_truncate, "safetensors"),
    (_corrupt_header, "safetensors"),
    (_pickle_instead, "pickle"),
])
def test_bad_adapters_are_refused_and_registry_keeps_serving(system, breaker, needle):
    path = _adapter_copy(system, f"bad-{breaker.__name__.strip('_')}")
    breaker(path)
    reply = _register(system, path.name, path)
    assert reply.status_code == 400, reply.text
    assert needle in error_message(reply).lower()
    assert not (path / "UNPICKLED").exists()
    listing = requests.get(f"{system.admin_base}/adapters/{path.name}",
                           headers={"Authorization": f"Bearer {system.admin_key}"}, timeout=10)
    assert listing.status_code == 404


def test_admin_api_key_is_required(system):
    path = _adapter_copy(system, "keyless")
    assert _register(system, "keyless", path, key=None).status_code == 401
    assert _register(system, "keyless", path, key="wrong-key").status_code == 403
    created = _register(system, "keyless", path)
    assert created.status_code == 201, created.text
    auth = {"Authorization": f"Bearer {system.admin_key}"}
    assert requests.delete(f"{system.admin_base}/adapters/keyless", headers=auth, timeout=10).status_code in (200, 204)
