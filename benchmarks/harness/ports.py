"""Free loopback ports for the processes tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port_run(n: int) -> int:
    """The first of `n` consecutive free ports (`tessera up`'s k-th worker binds worker.grpc_port + k)."""
    for _ in range(100):
        first = free_port()
        if first + n <= 65535 and all(port_free(first + k) for k in range(1, n)):
            return first
    raise RuntimeError(f"no {n} consecutive free ports")


def free_port_plan(singles: list[str], runs: list[str], run_length: int) -> dict[str, int]:
    """A free port for each of `singles` and the first of `run_length` free consecutive ports for each of
    `runs`, no two overlapping (a port is free when chosen, not reserved: each is checked against the
    others)."""
    taken: set[int] = set()
    plan: dict[str, int] = {}
    for name in runs:
        while True:
            first = free_port_run(run_length)
            ports = set(range(first, first + run_length))
            if not ports & taken:
                break
        taken |= ports
        plan[name] = first
    for name in singles:
        while (port := free_port()) in taken:
            pass
        taken.add(port)
        plan[name] = port
    return plan
