"""The `tessera` command: argument parsing, `config`, `health`, and demo-asset registration."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from services.cli import DemoRegistrationError, main, register_demo_assets
from services.common.adapter_layout import directory_digest
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


def _serve_fake_role(role: str) -> tuple[str, subprocess.Popen]:
    """fake_role.py as `role` (secured as that role is, from the environment's config) on a free port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"127.0.0.1:{port}", subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("fake_role.py")), str(port), role])


def test_health_exits_0_while_serving_and_1_once_gone(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    address, server = _serve_fake_role("gateway")  # the public port: plaintext by default
    try:
        deadline = time.monotonic() + 10
        while main(["health", address, "--role", "gateway", "--timeout", "0.5"]) != 0:
            assert time.monotonic() < deadline, "fake role never became healthy"
            time.sleep(0.1)
        assert f"{address}: SERVING" in capsys.readouterr().out
    finally:
        server.terminate()
        server.wait()
    assert main(["health", address, "--role", "gateway", "--timeout", "0.5"]) == 1
    assert f"{address}: unreachable: UNAVAILABLE: " in capsys.readouterr().out, "nothing listens: it says so"


def test_health_probes_an_internal_role_with_its_cluster_certificate(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    assert main(["certs"]) == 0
    address, server = _serve_fake_role("registry")  # requires a cluster client certificate
    try:
        deadline = time.monotonic() + 10
        while main(["health", address, "--role", "registry", "--timeout", "0.5"]) != 0:
            assert time.monotonic() < deadline, "fake registry never became healthy"
            time.sleep(0.1)
        capsys.readouterr()
        # Probed as the public gateway port is (no certificate), the registry does not answer.
        assert main(["health", address, "--role", "gateway", "--timeout", "0.5"]) == 1
        assert f"{address}: unreachable: " in capsys.readouterr().out
    finally:
        server.terminate()
        server.wait()


def test_health_of_an_internal_role_without_certificates_names_the_fix(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    assert main(["health", "127.0.0.1:1", "--role", "worker"]) == 2
    assert "tessera certs" in capsys.readouterr().err


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
        # The registry records the content digest of both files (common.proto, Adapter.sha256).
        self.adapters[name] = FakeRecord(name, sha256=directory_digest(Path(source_dir)))
        return self.adapters[name]


@pytest.mark.parametrize("role, key", [("gateway", "http_port"), ("registry", "admin_port"),
                                       ("worker", "metrics_port")])
def test_serve_with_a_taken_port_says_which_in_one_line(tmp_path: Path, monkeypatch, capsys, role: str,
                                                         key: str) -> None:
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        monkeypatch.setenv(f"TESSERA_{role.upper()}__{key.upper()}", str(port))
        assert main(["serve", role]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: port {port} ({role}.{key} on 127.0.0.1) is already in use; stop whatever "
                          f"holds it or change {role}.{key}") and "Traceback" not in err


def test_serve_worker_on_cuda_without_a_cuda_device_says_so_in_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the refusal is for one without")
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    monkeypatch.setenv("TESSERA_TLS__ENABLED", "false")
    monkeypatch.setenv("TESSERA_WORKER__DEVICE", "cuda")
    monkeypatch.setenv("TESSERA_WORKER__REGISTRY_ADDRESS", "127.0.0.1:1")  # never asked: it fails first
    assert main(["serve", "worker"]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("config error:")]  # after the TLS-off warning
    assert line.startswith("config error: worker.device is 'cuda', but this torch (") and "sees no CUDA device" in line
    assert "set worker.device: cpu" in line and "Traceback" not in err


def make_assets(root: Path) -> DemoAssets:
    adapter_dirs = {}
    for name in ("demo-r8", "demo-r16"):
        adapter_dirs[name] = root / name
        adapter_dirs[name].mkdir(parents=True)
        (adapter_dirs[name] / "adapter_model.safetensors").write_bytes(name.encode())
        (adapter_dirs[name] / "adapter_config.json").write_text('{"lora_alpha": 16}')
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


def test_up_workers_n_plans_n_workers_of_the_base_model(tmp_path: Path, monkeypatch, capfd) -> None:
    """`tessera up --workers 2` binds worker.grpc_port and the port after it: with that one taken it stops
    before starting anything, naming the second worker's port."""
    with socket.socket() as holder:
        while True:  # a free port whose next one this test can hold
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            try:
                holder.bind(("127.0.0.1", port + 1))
                break
            except OSError:
                continue
        holder.listen()
        monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
        monkeypatch.setenv("TESSERA_WORKER__GRPC_PORT", str(port))
        assert main(["up", "--workers", "2"]) == 1
    assert f"port {port + 1} (worker.grpc_port + 1 on 127.0.0.1) is already in use" in capfd.readouterr().err
    assert not (tmp_path / "run" / "launcher.json").exists()
