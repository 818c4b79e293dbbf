"""Running the launch plan (plan.py): start its children, watch them, stop them.

`launch` checks the plan before anything starts (ports free, base models registered, the cluster's TLS
certificates made), then starts the registry (the others register with / read from it), then the
workers (together), then the gateway, each role healthy before the next. Each child runs
`python -m services.cli serve <role>` in its own process group, so a Ctrl-C in the terminal reaches
only the launcher, which then stops the children in order.
A child that dies after startup is restarted with exponential backoff; the state of every
child (pid, restarts) is kept in `<run_path>/launcher.json`, rewritten atomically on change.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import signal
import subprocess
import threading
import time
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.config import LauncherConfig, TesseraConfig
from services.launcher.plan import (CommandBuilder, LaunchError, RoleSpec, admin_key_location, check_ports_free,
                                    check_registered, endpoint_urls, ensure_certs, registered_base_models,
                                    role_specs, worker_models)

if TYPE_CHECKING:
    import grpc

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.2
STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL whatever is still running after this


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
