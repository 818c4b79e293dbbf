"""The real system on loopback, started as a user starts it, for the live suites (gateway_load,
served_bench, placement_live) and the integration tests: a private TESSERA_HOME, free ports, each role
waited for until it answers its health check (its process watched: an exit fails the wait at once) and
the gateway routes, every process group stopped on exit.

    env = system_env(home, len(DEMO_MODELS), {"GATEWAY__MAX_QUEUED_PER_MODEL": 64})
    run_cli(["demo-assets"], env, timeout_s=900)
    with tessera_up(env, DEMO_MODELS, home / "launcher.log") as system:   # every role under one launcher
        system.http_base, system.worker_grpc, system.admin("/workers")
    with served_roles(env, log_dir, "bench-llama", timeout_s=420) as system:  # `tessera serve <role>` each
        ...
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import grpc

from benchmarks.harness.completions import Request, rest_stream
from benchmarks.harness.ports import free_port_plan
from benchmarks.harness.report import progress
from services.common.config import TesseraConfig, load_config
from services.common.grpc_server import check_health
from services.common.tls import TlsError, health_probe_credentials, load_role_credentials
from services.demo_assets import DEMO_BASE_MODEL, DEMO_QWEN2VL_BASE_MODEL, DEMO_VISION_BASE_MODEL
from services.launcher.supervisor import stop_process_group

REPO_ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "services.cli"]
ROLE_PORTS = ("REGISTRY__GRPC_PORT", "REGISTRY__ADMIN_PORT", "REGISTRY__METRICS_PORT", "GATEWAY__HTTP_PORT",
              "GATEWAY__GRPC_PORT", "GATEWAY__METRICS_PORT")
WORKER_PORTS = ("WORKER__GRPC_PORT", "WORKER__METRICS_PORT")  # the k-th worker's are these + k
# The base models `tessera demo-assets` registers, ordered by name as `tessera up` starts their workers.
DEMO_MODELS = tuple(sorted((DEMO_BASE_MODEL, DEMO_VISION_BASE_MODEL, DEMO_QWEN2VL_BASE_MODEL)))


def system_env(home: Path, workers: int, settings: Mapping[str, object]) -> dict[str, str]:
    """The roles' environment: this process's without its TESSERA_ settings; TESSERA_HOME; free ports,
    distinct, a run of `workers` for each worker port; the registry's address for the gateway and the
    workers; this repository on PYTHONPATH (not protos/: the generated stubs come from the installed package,
    as a user's do, so a packaging slip fails here); unbuffered output; then `settings` (names without TESSERA_)."""
    ports = free_port_plan(list(ROLE_PORTS), list(WORKER_PORTS), workers)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    path = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    registry = f"127.0.0.1:{ports['REGISTRY__GRPC_PORT']}"
    env.update({f"TESSERA_{name}": str(port) for name, port in ports.items()})
    env.update({"TESSERA_HOME": str(home), "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1",
                "TESSERA_GATEWAY__REGISTRY_ADDRESS": registry, "TESSERA_WORKER__REGISTRY_ADDRESS": registry})
    env.update({f"TESSERA_{name}": str(value) for name, value in settings.items()})
    return env


def run_cli(arguments: list[str], env: dict[str, str], timeout_s: float) -> None:
    """`tessera <arguments>` to its end (demo-assets, certs); what it printed goes into the error if it fails."""
    done = subprocess.run([*CLI, *arguments], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"tessera {' '.join(arguments)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


def spawn_role(role: str, env: dict[str, str], log: TextIO) -> subprocess.Popen:
    """One process of `role` (`tessera serve <role>`) configured by `env`, in a process group of its own."""
    return subprocess.Popen([*CLI, "serve", role], env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def log_tail(path: Path, lines: int = 80) -> str:
    """The last `lines` of a log the roles write: what a failed start left for the reader."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stop_role(process: subprocess.Popen) -> None:
    stop_process_group(process, signal.SIGTERM, grace_s=20)


@dataclass
class RunningSystem:
    """A system on loopback: its environment (home, ports), the addresses it serves, the process of
    `tessera up` where that started it (None: its roles run one by one), and the log it writes."""
    env: dict[str, str]
    worker_models: tuple[str, ...]  # each worker's base model, the k-th on the worker ports + k
    process: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def home(self) -> Path:
        return Path(self.env["TESSERA_HOME"])

    @property
    def config(self) -> TesseraConfig:
        return load_config(environ=self.env)

    def port(self, name: str) -> int:
        """A port the roles were given, by its setting's name ("GATEWAY__HTTP_PORT")."""
        return int(self.env[f"TESSERA_{name}"])

    @property
    def http_port(self) -> int:
        return self.port("GATEWAY__HTTP_PORT")

    @property
    def http_base(self) -> str:
        """The OpenAI-compatible REST base URL (…/v1)."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    @property
    def gateway_grpc(self) -> str:
        return f"127.0.0.1:{self.port('GATEWAY__GRPC_PORT')}"

    @property
    def registry_grpc(self) -> str:
        return f"127.0.0.1:{self.port('REGISTRY__GRPC_PORT')}"

    @property
    def admin_base(self) -> str:
        """The admin API's base URL (…/admin/v1)."""
        return f"http://127.0.0.1:{self.port('REGISTRY__ADMIN_PORT')}/admin/v1"

    @property
    def admin_key(self) -> str:
        return (self.home / "admin_api_key").read_text().strip()

    def worker_address(self, k: int) -> str:
        return f"127.0.0.1:{self.port('WORKER__GRPC_PORT') + k}"

    @property
    def worker_grpc(self) -> str:
        """The first worker's gRPC address (of the demo's three, the Llama's)."""
        return self.worker_address(0)

    @property
    def worker_metrics(self) -> str:
        """The first worker's metrics page."""
        return f"http://127.0.0.1:{self.port('WORKER__METRICS_PORT')}/metrics"

    def launcher_state(self) -> dict:
        return json.loads((self.home / "run" / "launcher.json").read_text())

    def child_pid(self, role: str, base_model: str = DEMO_BASE_MODEL) -> int:
        """The pid of `tessera up`'s child `role` (the worker serving `base_model`)."""
        children = self.launcher_state()["children"]
        return int(next(c["pid"] for c in children
                        if c["role"] == role and (role != "worker" or c["base_model"] == base_model)))

    def internal_channel(self, address: str) -> grpc.Channel:
        """A channel to the registry or a worker, presenting the gateway's cluster certificate."""
        return grpc.secure_channel(address, load_role_credentials(self.config, "gateway").channel())

    def admin(self, path: str) -> dict:
        """The admin API's answer to GET `path` (under …/admin/v1), with the admin key."""
        request = urllib.request.Request(f"{self.admin_base}{path}",
                                         headers={"Authorization": f"Bearer {self.admin_key}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def wait_healthy(self, address: str, role: str, timeout_s: float = 120.0,
                     process: subprocess.Popen | None = None, log: Path | None = None) -> None:
        """Until `role` at `address` answers its health check (probed as `tessera health --role` does).
        `process`: the role's own (or its launcher), whose exit fails the wait at once; `log`: where it
        writes, whose tail the failure shows."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{role} for {address} exited ({process.returncode}) before it was healthy"
                                   + _shown(log))
            try:
                credentials = health_probe_credentials(self.config, role)
            except TlsError:  # `tessera up` has not written the certificates yet
                time.sleep(0.2)
                continue
            if check_health(address, timeout_s=1.0, credentials=credentials):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{address} not healthy after {timeout_s}s" + _shown(log))

    def wait_worker_registered(self, timeout_s: float = 60.0) -> None:
        """Until the gateway routes: a completion for the first worker's base model streams to its end."""
        deadline = time.monotonic() + timeout_s
        probe = Request("ready", "ping", self.worker_models[0], 1)
        while not (result := asyncio.run(rest_stream(self.http_port, probe, 30))).done:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tessera up exited ({self.process.returncode})" + _shown(self.log))
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway cannot route to a worker: {result.error}" + _shown(self.log))
            time.sleep(0.3)

    def wait_workers_listed(self, timeout_s: float) -> None:
        """Until the registry lists every worker healthy (each registered and heartbeating)."""
        deadline = time.monotonic() + timeout_s
        while len([w for w in self.admin("/workers")["workers"] if w["healthy"]]) < len(self.worker_models):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the registry does not list {len(self.worker_models)} healthy workers")
            time.sleep(0.3)


def _shown(log: Path | None) -> str:
    return f"; its log ends:\n{log_tail(log)}" if log is not None and log.exists() else ""


@contextmanager
def tessera_up(env: dict[str, str], worker_models: Sequence[str], log_path: Path,
               timeout_s: float = 180.0) -> Iterator[RunningSystem]:
    """`tessera up` as a user starts it, every role's output to `log_path`; yields once the registry, each
    worker and the gateway answer their health checks, the gateway routes and the registry lists every
    worker (each wait within `timeout_s`; the launcher's exit fails it at once). On exit: SIGINT, as
    Ctrl-C, and the group killed after 30 s; the log's tail printed if the launcher did not stop cleanly."""
    with open(log_path, "w") as log:
        process = subprocess.Popen([*CLI, "up"], env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        system = RunningSystem(env, tuple(worker_models), process, log_path)
        try:
            for address, role in ((system.registry_grpc, "registry"),
                                  *((system.worker_address(k), "worker") for k in range(len(worker_models))),
                                  (system.gateway_grpc, "gateway")):
                system.wait_healthy(address, role, timeout_s, process, log_path)
            system.wait_worker_registered(timeout_s)
            system.wait_workers_listed(timeout_s)
            yield system
        finally:
            stop_process_group(process, signal.SIGINT, grace_s=30)
            if process.returncode not in (0, -signal.SIGINT):
                print(f"tessera up exited with {process.returncode}{_shown(log_path)}", flush=True)


@contextmanager
def served_roles(env: dict[str, str], log_dir: Path, worker_model: str, timeout_s: float) -> Iterator[RunningSystem]:
    """`tessera certs`, then `tessera serve` registry, worker (of `worker_model`) and gateway, each in its
    own process group with its own log (log_dir/<role>.log), each healthy (within `timeout_s`) before the
    next starts; yields once the gateway routes to the worker. Every role is stopped on exit."""
    run_cli(["certs"], env, timeout_s=60)
    system = RunningSystem(env, (worker_model,))
    processes: list[subprocess.Popen] = []
    logs: list[TextIO] = []
    try:
        for role, address in (("registry", system.registry_grpc), ("worker", system.worker_grpc),
                              ("gateway", system.gateway_grpc)):
            log_path = log_dir / f"{role}.log"
            logs.append(open(log_path, "w"))
            processes.append(spawn_role(role, env, logs[-1]))
            started = time.monotonic()
            system.wait_healthy(address, role, timeout_s, processes[-1], log_path)
            progress(f"{role} healthy at {address} after {time.monotonic() - started:.1f} s")
        system.wait_worker_registered(120.0)
        yield system
    finally:
        for process in reversed(processes):
            stop_role(process)
        for log in logs:
            log.close()
