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
