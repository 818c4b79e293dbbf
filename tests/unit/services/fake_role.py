"""A stand-in for a Tessera role in launcher tests: a gRPC health server on PORT, nothing else.

`fake_role.py PORT ROLE` serves SERVING until SIGTERM, secured as the real ROLE would be by the
config in the environment (registry and worker: mutual TLS with the role's cluster certificate;
gateway: its public port); `fake_role.py --exit CODE` dies at once (a role that fails during startup).
"""

from __future__ import annotations

import signal
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.config import load_config
from services.common.tls import cluster_credentials, gateway_public_credentials


def main() -> None:
    if sys.argv[1] == "--exit":
        sys.exit(int(sys.argv[2]))
    port, role = sys.argv[1], sys.argv[2]
    config = load_config()
    if role == "gateway":
        credentials = gateway_public_credentials(config)
    else:
        tls = cluster_credentials(config, role)
        credentials = tls.server() if tls else None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = f"127.0.0.1:{port}"
    if credentials is None:
        server.add_insecure_port(address)
    else:
        server.add_secure_port(address, credentials)
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(0)


if __name__ == "__main__":
    main()
