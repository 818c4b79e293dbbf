"""`tessera up`: run every role as a supervised child process on this machine.

Order: the cluster's TLS certificates first (created under tls.dir where missing, valid ones kept),
then the registry (the others register with / read from it), then the workers (together; one per
base model, or as launcher.workers says), then the gateway. Each child runs
`python -m services.cli serve <role>` in its own process group, so a Ctrl-C in the terminal reaches
only the launcher, which then stops the children in order.
A child that dies after startup is restarted with exponential backoff; the state of every
child (pid, restarts) is kept in `<run_path>/launcher.json`, rewritten atomically on change.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.config import LauncherConfig, TesseraConfig

if TYPE_CHECKING:
    import grpc

log = logging.getLogger(__name__)

# child -> argv of the process that serves it (the spec's env is added to the launcher's).
CommandBuilder = Callable[["RoleSpec"], list[str]]

POLL_INTERVAL_S = 0.2
STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL whatever is still running after this


class LaunchError(RuntimeError):
    """Startup cannot go on; the message names the role (and port or exit code) at fault."""


@dataclasses.dataclass(frozen=True, slots=True)
class RolePort:
    name: str  # the config key, e.g. "http_port"
    host: str
    port: int
    offset: int = 0  # the k-th worker binds its config key's port + k

    @property
    def key(self) -> str:
        return f"{self.name} + {self.offset}" if self.offset else self.name


@dataclasses.dataclass(frozen=True, slots=True)
class RoleSpec:
    role: str  # "registry" | "worker" | "gateway": the `tessera serve` argument
    health_address: str  # gRPC address answering the standard health service
    ports: tuple[RolePort, ...]  # every port the role binds (0 = disabled, not checked)
    name: str = ""  # what logs and launcher.json call this child; "" -> the role
    base_model: str = ""  # a worker's
    env: tuple[tuple[str, str], ...] = ()  # config overrides for this child alone (TESSERA_<SECTION>__<KEY>)

    @property
    def label(self) -> str:
        return self.name or self.role


def _connect_host(host: str) -> str:
    """A wildcard bind address is reached through loopback."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


def worker_models(config: TesseraConfig, registered: Sequence[str]) -> list[str]:
    """The base model of each worker to start, as launcher.workers and launcher.worker_models say (by
    default one for each of the `registered` base models)."""
    launcher = config.launcher
    if launcher.workers < 0:
        raise LaunchError(f"launcher.workers must be >= 0, got {launcher.workers}")
    if launcher.workers:
        return [config.worker.base_model] * launcher.workers
    return list(launcher.worker_models) or list(registered) or [config.worker.base_model]


def check_registered(models: Sequence[str], registered: Sequence[str]) -> None:
    """LaunchError, with the way out, if a worker would serve a base model the registry does not know: it
    would wait for it for ever (and the launcher give up on it after launcher.health_timeout_s)."""
    missing = sorted(set(models) - set(registered))
    if missing:
        known = f"registered: {', '.join(registered)}" if registered else "none is registered"
        raise LaunchError(
            f"base model {', '.join(map(repr, missing))} is not registered ({known}): run `tessera demo-assets` "
            "to build and register the demo models, or register yours (POST /admin/v1/base-models, README "
            "'Your own models'), or name registered ones in launcher.worker_models or worker.base_model")


def registered_base_models(config: TesseraConfig) -> list[str]:
    """The base models in the registry's database (read directly: the registry is not running yet)."""
    from sqlalchemy.exc import SQLAlchemyError

    from registry.store import RegistryStore

    try:
        store = RegistryStore.from_config(config)
    except SQLAlchemyError as exc:  # the URL may hold a password: name the key, not the value
        raise LaunchError(f"cannot read the registered base models from registry.database_url: "
                          f"{type(exc).__name__}") from exc
    try:
        return [model.name for model in store.list_base_models()]
    finally:
        store.close()


def _worker_specs(config: TesseraConfig, models: Sequence[str]) -> list[RoleSpec]:
    """One worker per entry of `models`, the k-th on worker.grpc_port + k (metrics_port + k)."""
    w = config.worker
    several = len(models) > 1
    if several and w.advertise_address:
        raise LaunchError("worker.advertise_address names one worker: leave it empty to start several")
    specs = []
    for k, model in enumerate(models):
        grpc_port, metrics_port = w.grpc_port + k, w.metrics_port + k if w.metrics_port else 0
        specs.append(RoleSpec(
            "worker", f"{_connect_host(w.host)}:{grpc_port}",
            (RolePort("grpc_port", w.host, grpc_port, k), RolePort("metrics_port", w.host, metrics_port, k)),
            name=f"worker {k} ({model})" if several else "", base_model=model,
            env=(("TESSERA_WORKER__BASE_MODEL", model), ("TESSERA_WORKER__GRPC_PORT", str(grpc_port)),
                 ("TESSERA_WORKER__METRICS_PORT", str(metrics_port)))))
    return specs


def role_specs(config: TesseraConfig, models: Sequence[str]) -> list[RoleSpec]:
    """The children in start order (the workers of `models` between registry and gateway), with the ports
    each binds."""
    specs = [_registry_spec(config), *_worker_specs(config, models), _gateway_spec(config)]
    for spec in specs:
        if any(p.name == "grpc_port" and p.port == 0 for p in spec.ports):
            raise LaunchError(f"{spec.role}.grpc_port is 0: the launcher needs a fixed port to health-check")
    return specs


def _registry_spec(config: TesseraConfig) -> RoleSpec:
    r = config.registry
    return RoleSpec("registry", f"{_connect_host(r.host)}:{r.grpc_port}", (
        RolePort("grpc_port", r.host, r.grpc_port), RolePort("admin_port", r.host, r.admin_port),
        RolePort("metrics_port", r.host, r.metrics_port)))


def _gateway_spec(config: TesseraConfig) -> RoleSpec:
    g = config.gateway
    return RoleSpec("gateway", f"{_connect_host(g.host)}:{g.grpc_port}", (
        RolePort("http_port", g.host, g.http_port), RolePort("grpc_port", g.host, g.grpc_port),
        RolePort("metrics_port", g.host, g.metrics_port)))


def served_role_spec(config: TesseraConfig, role: str) -> RoleSpec | None:
    """The ports `tessera serve <role>` binds (None: a role that binds none, the CPU LoRA sidecar)."""
    if role == "worker":
        (spec,) = _worker_specs(config, [config.worker.base_model])
        return spec
    return {"registry": _registry_spec, "gateway": _gateway_spec}.get(role, lambda _: None)(config)


def _metrics_url(spec: RoleSpec) -> str | None:
    port = next(p for p in spec.ports if p.name == "metrics_port")
    return f"http://{_connect_host(port.host)}:{port.port}/metrics" if port.port else None


def endpoint_urls(config: TesseraConfig, specs: Sequence[RoleSpec]) -> dict[str, object]:
    """What `tessera up` prints and records: where clients and operators connect."""
    r, g = config.registry, config.gateway
    urls: dict[str, object] = {
        "openai_rest": f"http://{_connect_host(g.host)}:{g.http_port}/v1",
        "gateway_grpc": f"{_connect_host(g.host)}:{g.grpc_port}",
        "admin_api": f"http://{_connect_host(r.host)}:{r.admin_port}",
        "registry_grpc": f"{_connect_host(r.host)}:{r.grpc_port}",
    }
    for spec in specs:
        if spec.role != "worker" and (metrics := _metrics_url(spec)):
            urls[f"{spec.role}_metrics"] = metrics
    urls["workers"] = [{"base_model": s.base_model, "grpc": s.health_address, "metrics": _metrics_url(s)}
                       for s in specs if s.role == "worker"]
    return urls


def admin_key_location(config: TesseraConfig) -> str:
    if config.registry.admin_api_key:
        return "set in the config (registry.admin_api_key)"
    return str(config.admin_api_key_path)


def check_ports_free(specs: Sequence[RoleSpec]) -> None:
    """Fail before starting anything if a configured port is taken (by another Tessera, say)."""
    for spec in specs:
        for p in spec.ports:
            if p.port == 0:
                continue
            with socket.socket(socket.AF_INET6 if ":" in p.host.strip("[]") else socket.AF_INET) as sock:
                # SO_REUSEADDR: a port left in TIME_WAIT by a previous run is free for a listener.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((p.host.strip("[]"), p.port))
                except OSError as exc:
                    reason = "is already in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc})"
                    raise LaunchError(f"port {p.port} ({spec.role}.{p.key} on {p.host}) {reason}; "
                                      f"stop whatever holds it or change {spec.role}.{p.name}") from exc


def serve_command(config_file: str | None) -> CommandBuilder:
    """The real children: this interpreter running `services.cli serve <role>`."""
    def build(spec: RoleSpec) -> list[str]:
        config_args = ["--config", config_file] if config_file else []
        return [sys.executable, "-m", "services.cli", *config_args, "serve", spec.role]
    return build


def restart_delay_s(failures_in_a_row: int, launcher: LauncherConfig) -> float:
    """Exponential backoff: restart_backoff_s, twice that, ... capped at max_restart_backoff_s.

    A child that ran at least max_restart_backoff_s before dying counts as recovered, so its
    next failure starts again at failures_in_a_row = 1 (the caller resets the count).
    """
    assert failures_in_a_row >= 1
    return min(launcher.restart_backoff_s * 2 ** (failures_in_a_row - 1), launcher.max_restart_backoff_s)


@dataclasses.dataclass(slots=True)
class Child:
    spec: RoleSpec
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    failures_in_a_row: int = 0  # consecutive quick deaths; drives the backoff
    started_at: float = 0.0
    restart_at: float | None = None  # set while a dead child waits out its backoff


class Supervisor:
    """Starts, watches and stops the role children. `command` is injected so tests use fakes."""

    def __init__(self, config: TesseraConfig, specs: Sequence[RoleSpec], command: CommandBuilder,
                 state_path: Path, urls: dict[str, object]) -> None:
        from services.common.tls import health_probe_credentials

        self.launcher = config.launcher
        self.children = [Child(spec) for spec in specs]
        # Each role is probed as `tessera health --role ROLE` would: with its own cluster certificate.
        self.probes: dict[str, grpc.ChannelCredentials | None] = {
            spec.role: health_probe_credentials(config, spec.role) for spec in specs}
        self.command = command
        self.state_path = state_path
        self.urls = urls

    def _spawn(self, child: Child) -> None:
        # start_new_session: own process group, so the terminal's Ctrl-C reaches only the launcher
        # and killpg also reaches anything the child spawns. stdout/stderr are inherited.
        child.process = subprocess.Popen(self.command(child.spec), env={**os.environ, **dict(child.spec.env)},
                                         start_new_session=True)
        child.started_at = time.monotonic()
        child.restart_at = None
        log.info("started %s (pid %d)", child.spec.label, child.process.pid)

    def _wait_healthy(self, child: Child, stop: threading.Event) -> bool:
        """True once healthy; False if `stop` was set first. Raises if the child dies or times out."""
        from services.common.grpc_server import check_health

        assert child.process is not None
        deadline = time.monotonic() + self.launcher.health_timeout_s
        while not check_health(child.spec.health_address, credentials=self.probes[child.spec.role]):
            code = child.process.poll()
            if code is not None:
                raise LaunchError(f"{child.spec.label} exited with code {code} during startup "
                                  f"(its log is above)")
            if stop.is_set():
                return False
            if time.monotonic() > deadline:
                raise LaunchError(f"{child.spec.label} was not healthy at {child.spec.health_address} "
                                  f"within {self.launcher.health_timeout_s:.0f} s")
            stop.wait(POLL_INTERVAL_S)
        log.info("%s is healthy at %s", child.spec.label, child.spec.health_address)
        return True

    def start_all(self, stop: threading.Event) -> bool:
        """Start each role in order, all of a role's children together and healthy before the next
        role's; False if stopped meanwhile."""
        for _, group in itertools.groupby(self.children, key=lambda c: c.spec.role):
            children = list(group)
            for child in children:
                self._spawn(child)
            self.write_state()
            if not all(self._wait_healthy(child, stop) for child in children):
                return False
        return True

    def poll_once(self) -> None:
        """Notice dead children and restart those whose backoff has passed."""
        now = time.monotonic()
        changed = False
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restarts += 1
                    self._spawn(child)
                    changed = True
                continue
            assert child.process is not None
            code = child.process.poll()
            if code is None:
                continue
            ran_s = now - child.started_at
            child.failures_in_a_row = 1 if ran_s >= self.launcher.max_restart_backoff_s else child.failures_in_a_row + 1
            delay = restart_delay_s(child.failures_in_a_row, self.launcher)
            child.restart_at = now + delay
            log.warning("%s (pid %d) exited with code %d; restarting in %.1f s (restart #%d)",
                        child.spec.label, child.process.pid, code, delay, child.restarts + 1)
        if changed:
            self.write_state()

    def supervise(self, stop: threading.Event) -> None:
        while not stop.wait(POLL_INTERVAL_S):
            self.poll_once()

    def stop_all(self) -> None:
        """SIGTERM every running child (gateway first), wait, then SIGKILL stragglers."""
        running = [c.process for c in reversed(self.children) if c.process and c.process.poll() is None]
        for process in running:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in running:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("pid %d ignored SIGTERM for %.0f s; killing it", process.pid, STOP_GRACE_S)
                _signal_group(process, signal.SIGKILL)
                process.wait()
        self.state_path.unlink(missing_ok=True)

    def state(self) -> dict[str, object]:
        return {
            "launcher_pid": os.getpid(),
            "children": [
                {"role": c.spec.role, "name": c.spec.label, "base_model": c.spec.base_model,
                 "pid": c.process.pid if c.process else None, "restarts": c.restarts,
                 "health_address": c.spec.health_address}
                for c in self.children
            ],
            "urls": self.urls,
        }

    def write_state(self) -> None:
        """Atomic rewrite: readers never see a half-written file."""
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.state(), indent=2) + "\n")
        os.replace(tmp, self.state_path)


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def stop_process_group(process: subprocess.Popen, first: signal.Signals = signal.SIGTERM,
                       grace_s: float = STOP_GRACE_S) -> None:
    """Send `first` to `process`'s group (a child started with start_new_session), wait up to `grace_s`,
    then SIGKILL the group: for callers that run one system or role as a child (benchmarks, tests)."""
    if process.poll() is None:
        _signal_group(process, first)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(process, signal.SIGKILL)
        process.wait()


def print_banner(config: TesseraConfig, urls: dict[str, object], state_path: Path) -> None:
    workers = typing.cast(list[dict[str, str]], urls["workers"])
    lines = [
        "Tessera is up.",
        f"  OpenAI-compatible REST  {urls['openai_rest']}",
        f"  gateway gRPC            {urls['gateway_grpc']}",
        f"  admin API               {urls['admin_api']}",
        f"  admin API key           {admin_key_location(config)}",
        *[f"  {name.replace('_', ' '):<23} {url}" for name, url in urls.items() if name.endswith("_metrics")],
        *[f"  worker {w['base_model']:<16} {w['grpc']}" + (f"  metrics {w['metrics']}" if w["metrics"] else "")
          for w in workers],
        f"  launcher state          {state_path}",
        "Press Ctrl-C to stop.",
    ]
    print("\n".join(lines), flush=True)


def ensure_certs(config: TesseraConfig) -> None:
    """The cluster CA and every role's certificate, as `tessera certs` makes them (valid ones kept)."""
    from services.common.tls import TlsError
    from services.common.tls_issue import ensure_cluster_certs

    if not (config.tls.enabled or config.tls.public_grpc_tls):
        return
    try:
        for line in ensure_cluster_certs(config):
            log.info("TLS: %s", line)
    except TlsError as exc:
        raise LaunchError(str(exc)) from exc


def launch(config: TesseraConfig, command: CommandBuilder,
           registered: Callable[[TesseraConfig], list[str]] = registered_base_models) -> int:
    """Run the whole system until SIGINT/SIGTERM; 0 on a clean stop, 1 if startup failed. `registered`:
    the base models the registry's database holds (launcher tests with fake roles have no database)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        known = registered(config)
        models = worker_models(config, known)
        specs = role_specs(config, models)
        check_ports_free(specs)
        check_registered(models, known)
        ensure_certs(config)
    except LaunchError as exc:
        log.error("%s", exc)
        return 1
    urls = endpoint_urls(config, specs)
    state_path = config.run_path / "launcher.json"
    supervisor = Supervisor(config, specs, command, state_path, urls)
    try:
        if supervisor.start_all(stop):
            print_banner(config, urls, state_path)
            supervisor.supervise(stop)
        log.info("stopping")
        return 0
    except LaunchError as exc:
        log.error("%s", exc)
        return 1
    finally:
        supervisor.stop_all()
