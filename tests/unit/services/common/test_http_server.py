"""services/common/http_server.py: the waitress server beside the asyncio loop starts, serves and closes."""

from __future__ import annotations

import socket

import requests
from flask import Flask

from services.common.http_server import WsgiServer


def _app() -> Flask:
    app = Flask(__name__)
    app.get("/ping")(lambda: "pong")
    return app


def test_serves_and_close_frees_the_port_even_when_the_loop_has_already_ended():
    server = WsgiServer(_app(), "127.0.0.1", 0, threads=2).start()
    assert requests.get(f"http://127.0.0.1:{server.port}/ping", timeout=5).text == "pong"
    server.close()
    assert not server._thread.is_alive()
    server.close()  # the loop and its trigger are gone: closing again must neither raise nor write to a stale fd
    with socket.socket() as s:  # the port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", server.port))
