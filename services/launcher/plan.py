"""The launch plan: which children `tessera up` starts, the ports each binds, the config overrides each
gets, where clients reach them; and what is checked before anything starts (free ports, registered
base models, the cluster's TLS certificates, created under tls.dir where missing, valid ones kept).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import socket
import sys
from collections.abc import Callable, Sequence

from services.common.config import TesseraConfig

log = logging.getLogger(__name__)

# child -> argv of the process that serves it (the spec's env is added to the launcher's).
CommandBuilder = Callable[["RoleSpec"], list[str]]


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
