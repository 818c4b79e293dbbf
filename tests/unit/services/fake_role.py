"""A stand-in for a Tessera role in launcher tests: a gRPC health server on PORT, nothing else.

`fake_role.py PORT` serves SERVING until SIGTERM; `fake_role.py --exit CODE` dies at once
(a role that fails during startup).
"""

from __future__ import annotations

import signal
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def main() -> None:
    if sys.argv[1] == "--exit":
        sys.exit(int(sys.argv[2]))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{sys.argv[1]}")
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(0)


if __name__ == "__main__":
    main()
