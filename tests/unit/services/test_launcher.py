"""The launcher's supervision, with fake roles (fake_role.py) in real child processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.common.config import LauncherConfig, load_config
from services.common.grpc_server import check_health
from services.common.tls import health_probe_credentials, tls_paths
from tests.ports import free_port_run
from services.launcher.plan import (LaunchError, check_ports_free, check_registered, registered_base_models, role_specs,
                                    worker_models)
from services.launcher.supervisor import restart_delay_s

REPO_ROOT = Path(__file__).resolve().parents[3]
FAKE_LAUNCHER = Path(__file__).with_name("fake_launcher.py")


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def fake_env(home: Path) -> dict[str, str]:
    registry_grpc, admin, gateway_http, gateway_grpc, worker_grpc = free_ports(5)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env.update({
        "TESSERA_HOME": str(home),
        "TESSERA_REGISTRY__GRPC_PORT": str(registry_grpc),
        "TESSERA_REGISTRY__ADMIN_PORT": str(admin),
        "TESSERA_GATEWAY__HTTP_PORT": str(gateway_http),
        "TESSERA_GATEWAY__GRPC_PORT": str(gateway_grpc),
        "TESSERA_WORKER__GRPC_PORT": str(worker_grpc),
        "TESSERA_REGISTRY__METRICS_PORT": "0",
        "TESSERA_GATEWAY__METRICS_PORT": "0",
        "TESSERA_WORKER__METRICS_PORT": "0",
        "TESSERA_LAUNCHER__WORKER_MODELS": "[fake-model]",
        "TESSERA_LAUNCHER__HEALTH_TIMEOUT_S": "20",
        "TESSERA_LAUNCHER__RESTART_BACKOFF_S": "0.1",
        "TESSERA_LAUNCHER__MAX_RESTART_BACKOFF_S": "1",
        "PYTHONPATH": str(REPO_ROOT),
    })
    return env


def healthy(env: dict[str, str], role: str, port_key: str) -> bool:
    """`tessera health --role ROLE`'s probe: internal roles with their own cluster certificate."""
    config = load_config(environ=env)
    return check_health(f"127.0.0.1:{env[port_key]}", credentials=health_probe_credentials(config, role))


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def read_state(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[1][0] != "Z"


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(env: dict[str, str]) -> subprocess.Popen[str]:
        process = subprocess.Popen([sys.executable, str(FAKE_LAUNCHER)], env=env, cwd=REPO_ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(process)
        return process

    yield start
    for process in started:  # a failed test must not leave fake roles behind
        state = read_state(tmp_path / "run" / "launcher.json")
        if process.poll() is None:
            process.kill()
            process.wait()
        for child in (state or {}).get("children", []):
            if child["pid"] and alive(child["pid"]):
                os.killpg(child["pid"], signal.SIGKILL)


def test_restarts_a_crashed_child_and_stops_everything_on_sigint(tmp_path: Path, launcher) -> None:
    env = fake_env(tmp_path)
    process = launcher(env)
    state_path = tmp_path / "run" / "launcher.json"
    started = wait_for(lambda: (s := read_state(state_path)) and all(c["pid"] for c in s["children"])
                       and len(s["children"]) == 3 and s, 20, "all roles started")
    assert started["launcher_pid"] == process.pid
    assert started["urls"]["openai_rest"] == f"http://127.0.0.1:{env['TESSERA_GATEWAY__HTTP_PORT']}/v1"
    wait_for(lambda: check_health(f"127.0.0.1:{env['TESSERA_GATEWAY__GRPC_PORT']}"), 20, "gateway healthy")

    worker = next(c for c in started["children"] if c["role"] == "worker")
    os.kill(worker["pid"], signal.SIGKILL)
    restarted = wait_for(
        lambda: (s := read_state(state_path)) and next(c for c in s["children"] if c["role"] == "worker")["restarts"] == 1
        and s, 10, "worker restarted")
    new_worker = next(c for c in restarted["children"] if c["role"] == "worker")
    assert new_worker["pid"] != worker["pid"]
    assert [c["restarts"] for c in restarted["children"] if c["role"] != "worker"] == [0, 0]
    wait_for(lambda: healthy(env, "worker", "TESSERA_WORKER__GRPC_PORT"), 10, "restarted worker healthy")

    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=15) == 0
    out, err = process.communicate()
    assert "Tessera is up." in out
    assert "worker" in err and "exited with code -9" in err
    for child in restarted["children"]:
        assert not alive(child["pid"]), f"{child['role']} still running after the launcher stopped"
    assert not state_path.exists()


def test_a_role_dying_during_startup_fails_the_launch_naming_it(tmp_path: Path, launcher) -> None:
    env = fake_env(tmp_path) | {"FAKE_FAIL_ROLE": "worker"}
    process = launcher(env)
    assert process.wait(timeout=20) == 1
    _, err = process.communicate()
    assert "worker exited with code 3 during startup" in err
    assert not healthy(env, "registry", "TESSERA_REGISTRY__GRPC_PORT"), \
        "the registry started before the failure must be stopped"


def test_a_port_in_use_is_named_with_its_role(tmp_path: Path) -> None:
    env = fake_env(tmp_path)
    config = load_config(environ=env)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", config.gateway.http_port))
        holder.listen()
        with pytest.raises(LaunchError, match=rf"port {config.gateway.http_port} \(gateway.http_port on 127.0.0.1\) "
                                               r"is already in use"):
            check_ports_free(role_specs(config, ["fake-model"]))
    check_ports_free(role_specs(config, ["fake-model"]))  # free again once released


def test_a_port_in_use_stops_the_launcher_before_it_starts_anything(tmp_path: Path, launcher) -> None:
    env = fake_env(tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", int(env["TESSERA_WORKER__GRPC_PORT"])))
        holder.listen()
        process = launcher(env)
        assert process.wait(timeout=15) == 1
    _, err = process.communicate()
    assert f"port {env['TESSERA_WORKER__GRPC_PORT']} (worker.grpc_port on 127.0.0.1) is already in use" in err
    assert not (tmp_path / "run" / "launcher.json").exists()


def test_up_with_an_unregistered_base_model_refuses_at_once_with_the_way_out(tmp_path: Path, monkeypatch,
                                                                            capfd) -> None:
    """The README's `TESSERA_HOME=/srv/tessera tessera up` on an empty home: no worker waiting for ever."""
    from services.cli import main

    for key, value in fake_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    assert main(["up"]) == 1
    err = capfd.readouterr().err
    assert "base model 'fake-model' is not registered (none is registered): run `tessera demo-assets`" in err
    assert not (tmp_path / "run" / "launcher.json").exists(), "nothing was started"


def test_restart_delay_doubles_up_to_the_cap() -> None:
    launcher_config = LauncherConfig(restart_backoff_s=1.0, max_restart_backoff_s=5.0)
    assert [restart_delay_s(n, launcher_config) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_a_grpc_port_of_zero_is_refused() -> None:
    config = load_config(environ={"TESSERA_WORKER__GRPC_PORT": "0"})
    with pytest.raises(LaunchError, match="worker.grpc_port is 0"):
        role_specs(config, ["fake-model"])


def test_up_creates_the_cluster_certificates_and_probes_internal_roles_over_mutual_tls(tmp_path: Path,
                                                                                       launcher) -> None:
    env = fake_env(tmp_path)
    process = launcher(env)
    wait_for(lambda: check_health(f"127.0.0.1:{env['TESSERA_GATEWAY__GRPC_PORT']}"), 20, "every role healthy")
    paths = tls_paths(load_config(environ=env))
    assert stat.S_IMODE(paths.dir.stat().st_mode) == 0o700
    files = sorted(p.name for p in paths.dir.iterdir())
    assert files == sorted(["ca.pem", "ca-key.pem", *(f"{r}{s}.pem" for r in ("registry", "gateway", "worker")
                                                      for s in ("", "-key"))])
    assert {stat.S_IMODE((paths.dir / f).stat().st_mode) for f in files} == {0o600}
    registry = f"127.0.0.1:{env['TESSERA_REGISTRY__GRPC_PORT']}"
    assert healthy(env, "registry", "TESSERA_REGISTRY__GRPC_PORT")
    assert not check_health(registry), "a plaintext probe must not reach the registry"
    before = {f: (paths.dir / f).read_bytes() for f in files}
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=15) == 0

    again = launcher(env)  # a second `tessera up` keeps the certificates it finds
    wait_for(lambda: healthy(env, "worker", "TESSERA_WORKER__GRPC_PORT"), 20, "worker healthy again")
    assert {f: (paths.dir / f).read_bytes() for f in files} == before
    again.send_signal(signal.SIGINT)
    assert again.wait(timeout=15) == 0


def test_workers_n_starts_n_workers_of_the_base_model_on_consecutive_ports_each_restarted_alone(
        tmp_path: Path, launcher) -> None:
    first = free_port_run(3)
    env = fake_env(tmp_path) | {"TESSERA_LAUNCHER__WORKERS": "3", "TESSERA_WORKER__GRPC_PORT": str(first),
                                "TESSERA_WORKER__BASE_MODEL": "the-model"}
    process = launcher(env)
    state_path = tmp_path / "run" / "launcher.json"
    wait_for(lambda: check_health(f"127.0.0.1:{env['TESSERA_GATEWAY__GRPC_PORT']}"), 20, "gateway healthy")
    state = read_state(state_path)
    workers = [c for c in state["children"] if c["role"] == "worker"]
    assert [(w["base_model"], w["health_address"]) for w in workers] == [
        ("the-model", f"127.0.0.1:{first + k}") for k in range(3)]
    assert [w["grpc"] for w in state["urls"]["workers"]] == [w["health_address"] for w in workers]
    for k in range(3):
        assert healthy(env | {"TESSERA_WORKER__GRPC_PORT": str(first + k)}, "worker", "TESSERA_WORKER__GRPC_PORT")

    os.kill(workers[1]["pid"], signal.SIGKILL)
    restarted = wait_for(lambda: (s := read_state(state_path)) and s["children"][2]["restarts"] == 1 and s,
                         10, "the killed worker restarted")
    assert [c["restarts"] for c in restarted["children"]] == [0, 0, 1, 0, 0]
    wait_for(lambda: healthy(env | {"TESSERA_WORKER__GRPC_PORT": str(first + 1)}, "worker",
                             "TESSERA_WORKER__GRPC_PORT"), 10, "restarted worker healthy")
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=15) == 0
    out, _ = process.communicate()
    assert all("worker the-model" in line for line in out.splitlines() if line.strip().startswith("worker "))
    assert sum(line.strip().startswith("worker ") for line in out.splitlines()) == 3


def test_a_taken_port_of_a_later_worker_is_named_with_its_offset(tmp_path: Path) -> None:
    first = free_port_run(2)
    config = load_config(environ=fake_env(tmp_path) | {"TESSERA_WORKER__GRPC_PORT": str(first)})
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", first + 1))
        holder.listen()
        with pytest.raises(LaunchError, match=rf"port {first + 1} \(worker.grpc_port \+ 1 on 127.0.0.1\) "
                                               r"is already in use; .* change worker.grpc_port"):
            check_ports_free(role_specs(config, ["a", "b"]))


def test_one_worker_per_registered_base_model_unless_configured(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from registry.store import RegistryStore

    base = {"TESSERA_HOME": str(tmp_path), "TESSERA_WORKER__BASE_MODEL": "fallback"}
    config = load_config(environ=base)
    assert registered_base_models(config) == []
    assert worker_models(config, []) == ["fallback"], "nothing registered: worker.base_model"
    with pytest.raises(LaunchError, match=r"base model 'fallback' is not registered \(none is registered\): run "
                                          "`tessera demo-assets`"):
        check_registered(worker_models(config, []), [])
    store = RegistryStore.from_config(config)
    for name in ("model-b", "model-a"):
        LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, vocab_size=64)).save_pretrained(tmp_path / name)
        store.register_base_model(name, str(tmp_path / name))
    store.close()
    registered = registered_base_models(config)
    assert worker_models(config, registered) == ["model-a", "model-b"]
    assert worker_models(load_config(environ=base | {"TESSERA_LAUNCHER__WORKER_MODELS": "[model-b]"}),
                         registered) == ["model-b"]
    assert worker_models(load_config(environ=base | {"TESSERA_LAUNCHER__WORKERS": "2"}), registered) == ["fallback"] * 2
    with pytest.raises(LaunchError, match=r"base model 'fallback' is not registered \(registered: model-a, model-b\)"):
        check_registered(["fallback"] * 2, registered)
    with pytest.raises(LaunchError, match="launcher.workers must be >= 0"):
        worker_models(load_config(environ=base | {"TESSERA_LAUNCHER__WORKERS": "-1"}), registered)
    with pytest.raises(LaunchError, match="advertise_address names one worker"):
        role_specs(load_config(environ=base | {"TESSERA_WORKER__ADVERTISE_ADDRESS": "w:1"}), ["model-a", "model-b"])
