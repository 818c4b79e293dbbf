"""Fixtures that run the real system: `tessera demo-assets` then `tessera up` on loopback.

Everything runs as real processes on free ports under a temporary TESSERA_HOME,
exactly as a user would start it (a worker for each demo base model: the Llama, the LLaVA and the
Qwen2-VL), so these tests exercise every role boundary, with mutual TLS
between the roles on (the default): a test that calls a worker or the registry directly dials it
as the gateway does, with the gateway's cluster certificate (`RunningSystem.internal_channel`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import grpc
import pytest
import requests

from services.common.config import TesseraConfig, load_config
from services.common.grpc_server import check_health
from services.common.tls import TlsError, health_probe_credentials, load_role_credentials
from services.demo_assets import DEMO_BASE_MODEL, DEMO_QWEN2VL_BASE_MODEL, DEMO_VISION_BASE_MODEL
from services.launcher.supervisor import stop_process_group
from tests.ports import free_port_plan

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RunningSystem:
    home: Path
    env: dict[str, str]
    process: subprocess.Popen
    http_base: str          # OpenAI-compatible base URL (…/v1)
    gateway_grpc: str
    registry_grpc: str
    admin_base: str         # …/admin/v1
    worker_grpc: str        # the text model's worker (tessera-demo-llama)
    worker_metrics: str     # …/metrics
    admin_key: str
    workers: dict[str, str]  # base model -> its worker's gRPC address


    def launcher_state(self) -> dict:
        return json.loads((self.home / "run" / "launcher.json").read_text())

    def child_pid(self, role: str, base_model: str = DEMO_BASE_MODEL) -> int:
        """The pid of `role`'s child (of the worker serving `base_model`)."""
        children = self.launcher_state()["children"]
        return int(next(c["pid"] for c in children
                        if c["role"] == role and (role != "worker" or c["base_model"] == base_model)))

    @property
    def config(self) -> TesseraConfig:
        return load_config(environ=self.env)

    def internal_channel(self, address: str) -> grpc.Channel:
        """A channel to the registry or a worker, presenting the gateway's cluster certificate."""
        return grpc.secure_channel(address, load_role_credentials(self.config, "gateway").channel())

    def wait_healthy(self, address: str, role: str, timeout_s: float = 120.0,
                     process: subprocess.Popen | None = None) -> None:
        """Until `role` at `address` answers its health check (probed as `tessera health --role` does).
        `process`: the role's own process, whose exit fails the wait at once."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{role} for {address} exited ({process.returncode}) before it was healthy")
            try:
                credentials = health_probe_credentials(self.config, role)
            except TlsError:  # `tessera up` has not written the certificates yet
                time.sleep(0.2)
                continue
            if check_health(address, timeout_s=1.0, credentials=credentials):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{address} not healthy after {timeout_s}s")

    def wait_worker_registered(self, timeout_s: float = 60.0) -> None:
        """Until the gateway can route: a chat completion for the base model succeeds."""
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            last = requests.post(f"{self.http_base}/completions", json={
                "model": "tessera-demo-llama", "prompt": "ping", "max_tokens": 1}, timeout=30)
            if last.status_code == 200:
                return
            time.sleep(0.3)
        raise TimeoutError(f"gateway cannot route to a worker: {last.status_code} {last.text}")


def spawn_role(role: str, env: dict[str, str], log: TextIO) -> subprocess.Popen:
    """One more process of `role` (`tessera serve <role>`) beside the system's, configured by `env`."""
    return subprocess.Popen([sys.executable, "-m", "services.cli", "serve", role], env=env, cwd=REPO_ROOT,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def log_tail(path: Path, lines: int = 80) -> str:
    """The last `lines` of a log the spawned roles write: what a failed start left for the reader."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stop_role(process: subprocess.Popen) -> None:
    stop_process_group(process, signal.SIGTERM, grace_s=20)


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> None:
    proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture(scope="session")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSystem]:
    home = tmp_path_factory.mktemp("tessera-home")
    # Ordered by name, as `tessera up` starts them: the k-th on the worker ports + k.
    models = sorted((DEMO_BASE_MODEL, DEMO_VISION_BASE_MODEL, DEMO_QWEN2VL_BASE_MODEL))
    ports = free_port_plan(["REGISTRY__GRPC_PORT", "REGISTRY__ADMIN_PORT", "REGISTRY__METRICS_PORT",
                            "GATEWAY__HTTP_PORT", "GATEWAY__GRPC_PORT", "GATEWAY__METRICS_PORT"],
                           ["WORKER__GRPC_PORT", "WORKER__METRICS_PORT"], len(models))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env.update({f"TESSERA_{k}": str(v) for k, v in ports.items()})
    env.update({
        "TESSERA_HOME": str(home),
        "TESSERA_GATEWAY__REGISTRY_ADDRESS": f"127.0.0.1:{ports['REGISTRY__GRPC_PORT']}",
        "TESSERA_WORKER__REGISTRY_ADDRESS": f"127.0.0.1:{ports['REGISTRY__GRPC_PORT']}",
        "TESSERA_REGISTRY__HEARTBEAT_INTERVAL_MS": "300",
        "TESSERA_GATEWAY__METADATA_REFRESH_S": "0.5",
        "TESSERA_LAUNCHER__RESTART_BACKOFF_S": "0.2",
        "TESSERA_WORKER__CPU_LORA_SHM_DIR": str(home),
        "PYTHONUNBUFFERED": "1",
    })
    tessera = [sys.executable, "-m", "services.cli"]
    _run([*tessera, "demo-assets"], env, timeout=600)
    log = open(home / "launcher.log", "w")
    process = subprocess.Popen([*tessera, "up"], env=env, cwd=REPO_ROOT, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    running = RunningSystem(
        home=home, env=env, process=process,
        http_base=f"http://127.0.0.1:{ports['GATEWAY__HTTP_PORT']}/v1",
        gateway_grpc=f"127.0.0.1:{ports['GATEWAY__GRPC_PORT']}",
        registry_grpc=f"127.0.0.1:{ports['REGISTRY__GRPC_PORT']}",
        admin_base=f"http://127.0.0.1:{ports['REGISTRY__ADMIN_PORT']}/admin/v1",
        worker_grpc=f"127.0.0.1:{ports['WORKER__GRPC_PORT'] + models.index(DEMO_BASE_MODEL)}",
        worker_metrics=f"http://127.0.0.1:{ports['WORKER__METRICS_PORT'] + models.index(DEMO_BASE_MODEL)}/metrics",
        admin_key=(home / "admin_api_key").read_text().strip() if (home / "admin_api_key").exists() else "",
        workers={model: f"127.0.0.1:{ports['WORKER__GRPC_PORT'] + k}" for k, model in enumerate(models)},
    )
    try:
        for address, role in ((running.registry_grpc, "registry"), *((w, "worker") for w in running.workers.values()),
                              (running.gateway_grpc, "gateway")):
            running.wait_healthy(address, role, timeout_s=180, process=process)
        running.admin_key = (home / "admin_api_key").read_text().strip()
        running.wait_worker_registered()
        yield running
    finally:
        stop_process_group(process, signal.SIGINT, grace_s=30)
        log.close()
        if process.returncode not in (0, -signal.SIGINT):
            print((home / "launcher.log").read_text()[-5000:])
