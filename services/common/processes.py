"""Stopping the child processes a role started."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable


def stop_processes(processes: Iterable[subprocess.Popen | None], grace_s: float = 10.0) -> None:
    """SIGTERM every running one, then wait for each (up to `grace_s`) and SIGKILL any still running."""
    started = [p for p in processes if p is not None]
    for process in started:
        if process.poll() is None:
            process.terminate()
    for process in started:
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
