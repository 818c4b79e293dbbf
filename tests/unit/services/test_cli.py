"""The `tessera` command: argument parsing, `config`, `health`, and demo-asset registration."""

from __future__ import annotations

import dataclasses
import hashlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from services.cli import DemoRegistrationError, main, register_demo_assets
from services.common.config import TesseraConfig
from services.demo_assets import DEMO_BASE_MODEL, DemoAssets
from services.common.errors import NotFound

def test_config_prints_the_effective_config_as_yaml(tmp_path: Path, monkeypatch, capsys) -> None:
    path = tmp_path / "tessera.yaml"
    path.write_text("gateway:\n  http_port: 8000\n")
    monkeypatch.setenv("TESSERA_WORKER__DEVICE", "cuda")
    # --config is accepted after the subcommand too (scripts/run.sh passes its args there).
    assert main(["config", "--config", str(path)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = TesseraConfig()
    expected.gateway.http_port = 8000
    expected.worker.device = "cuda"
    assert printed == expected.to_dict()


def test_a_bad_config_exits_2_with_the_key_named(monkeypatch, capsys) -> None:
    monkeypatch.setenv("TESSERA_GATEWAY__HTTP_PORT", "fast")
    assert main(["config"]) == 2
    assert "gateway.http_port" in capsys.readouterr().err


def test_health_exits_0_while_serving_and_1_once_gone(capsys) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fake_role.py")), str(port)])
    try:
        deadline = time.monotonic() + 10
        while main(["health", address, "--timeout", "0.5"]) != 0:
            assert time.monotonic() < deadline, "fake role never became healthy"
            time.sleep(0.1)
        assert f"{address}: SERVING" in capsys.readouterr().out
    finally:
        server.terminate()
        server.wait()
    assert main(["health", address, "--timeout", "0.5"]) == 1
    assert "NOT SERVING" in capsys.readouterr().out


@dataclasses.dataclass
class FakeRecord:
    name: str
    path: str = ""
    sha256: str = ""
    rank: int = 8


class FakeStore:
    """The four RegistryStore calls register_demo_assets makes, over dicts."""

    def __init__(self) -> None:
        self.base_models: dict[str, FakeRecord] = {}
        self.adapters: dict[str, FakeRecord] = {}

    def get_base_model(self, name: str) -> FakeRecord:
        if name not in self.base_models:
            raise NotFound(f"no base model {name}")
        return self.base_models[name]

    def register_base_model(self, name: str, path: str) -> FakeRecord:
        self.base_models[name] = FakeRecord(name, path=path)
        return self.base_models[name]

    def get_adapter(self, name: str) -> FakeRecord:
        if name not in self.adapters:
            raise NotFound(f"no adapter {name}")
        return self.adapters[name]

    def register_adapter(self, name: str, base_model: str, source_dir: str) -> FakeRecord:
        assert base_model in self.base_models
        sha = hashlib.sha256((Path(source_dir) / "adapter_model.safetensors").read_bytes()).hexdigest()
        self.adapters[name] = FakeRecord(name, sha256=sha)
        return self.adapters[name]


def make_assets(root: Path) -> DemoAssets:
    adapter_dirs = {}
    for name in ("demo-r8", "demo-r16"):
        adapter_dirs[name] = root / name
        adapter_dirs[name].mkdir(parents=True)
        (adapter_dirs[name] / "adapter_model.safetensors").write_bytes(name.encode())
    return DemoAssets(base_dir=root / "base", adapter_dirs=adapter_dirs)


def test_registering_twice_leaves_identical_adapters_alone(tmp_path: Path) -> None:
    store, assets, lines = FakeStore(), make_assets(tmp_path), []
    register_demo_assets(store, assets, progress=lines.append)
    first = dict(store.adapters)
    register_demo_assets(store, assets, progress=lines.append)
    assert store.adapters == first and set(first) == {"demo-r8", "demo-r16"}
    assert store.base_models[DEMO_BASE_MODEL].path == str(assets.base_dir)
    assert sum("already registered" in line for line in lines) == 3  # base + 2 adapters, second run


def test_a_different_adapter_under_a_demo_name_is_an_error(tmp_path: Path) -> None:
    store, assets = FakeStore(), make_assets(tmp_path)
    register_demo_assets(store, assets, progress=lambda _: None)
    (assets.adapter_dirs["demo-r16"] / "adapter_model.safetensors").write_bytes(b"retrained")
    with pytest.raises(DemoRegistrationError, match="adapter demo-r16 is already registered with sha256"):
        register_demo_assets(store, assets, progress=lambda _: None)
