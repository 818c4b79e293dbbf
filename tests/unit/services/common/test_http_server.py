"""services/common/http_server.py: the loop server (uvicorn + FlaskAsgi) streams LoopResponses on the
loop and keeps its limits."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import requests
from flask import Flask

from services.common.errors import TesseraError
from services.common.flask_asgi import Head, LoopResponse
from services.common.http_server import HttpLimits, LoopHttpServer


def _error_body(exc: TesseraError) -> dict[str, Any]:
    return {"error": {"message": exc.message, "type": exc.error_type}}


class LoopServer:
    """A LoopHttpServer on an event loop of its own thread, as a role's main loop runs it."""

    def __init__(self, limits: HttpLimits, threads: int = 2) -> None:
        self.cancelled = threading.Event()
        app = Flask(__name__)
        app.add_url_rule("/ping", "ping", lambda: "pong", methods=["GET", "POST"])
        app.add_url_rule("/stream/<int:chunks>", "stream", lambda chunks: LoopResponse(self._stream(chunks)).flask())
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server = self.run(LoopHttpServer.start(app, "127.0.0.1", 0, threads=threads, limits=limits,
                                                    error_body=_error_body))
        self.port = self.server.port

    async def _stream(self, chunks: int) -> AsyncIterator[Head | bytes]:
        yield Head(200, [("Content-Type", "text/event-stream")])
        try:
            for i in range(chunks):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(20)

    def close(self) -> None:
        self.run(self.server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture
def limits() -> HttpLimits:
    return HttpLimits(max_connections=500, header_timeout_s=0.5, body_timeout_s=0.5, max_body_bytes=1000)


@pytest.fixture
def loop_server(limits: HttpLimits) -> Iterator[LoopServer]:
    server = LoopServer(limits)
    yield server
    server.close()


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def test_two_hundred_streams_are_served_at_once_by_two_handler_threads(loop_server: LoopServer) -> None:
    async def clients() -> list[bytes]:
        async def one() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", loop_server.port)
            writer.write(b"GET /stream/10 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = await reader.read()
            writer.close()
            return answer
        return list(await asyncio.gather(*(one() for _ in range(200))))

    started = time.monotonic()
    answers = asyncio.run(clients())
    # 200 streams of 10 chunks 50 ms apart: together ~0.5 s; one after another per thread, 50 s.
    assert time.monotonic() - started < 10
    assert all(a.startswith(b"HTTP/1.1 200") and a.count(b"data: ") == 10 for a in answers)


def test_a_client_that_leaves_cancels_its_stream(loop_server: LoopServer) -> None:
    with requests.get(f"http://127.0.0.1:{loop_server.port}/stream/1000", stream=True, timeout=5) as response:
        assert next(response.iter_lines()) == b"data: 0"
    assert loop_server.cancelled.wait(5), "the stream went on for a client that had left"


def test_a_silent_or_half_sent_request_is_closed_after_the_header_timeout(loop_server: LoopServer) -> None:
    for sent in (b"", b"GET /ping HTTP/1.1\r\nHost: x\r\n"):
        started = time.monotonic()
        assert _raw(loop_server.port, sent) == b""
        assert 0.4 < time.monotonic() - started < 3
    assert requests.get(f"http://127.0.0.1:{loop_server.port}/ping", timeout=5).text == "pong"


def test_a_body_too_large_is_413_and_a_body_too_slow_is_408(loop_server: LoopServer) -> None:
    large = _raw(loop_server.port, b"POST /ping HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000)
    assert large.startswith(b"HTTP/1.1 413")
    assert json.loads(large.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"
    slow = _raw(loop_server.port, b"POST /ping HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nxxxxx")
    assert slow.startswith(b"HTTP/1.1 408")


def test_connections_past_the_cap_get_503_with_retry_after_at_once() -> None:
    server = LoopServer(HttpLimits(max_connections=3, header_timeout_s=5))
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        time.sleep(0.2)
        started = time.monotonic()
        answer = _raw(server.port, b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        assert time.monotonic() - started < 1
        head, body = answer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower()
        assert "maximum of 3 connections" in json.loads(body)["error"]["message"]
        for sock in idle:
            sock.close()
        time.sleep(0.2)
        assert requests.get(f"http://127.0.0.1:{server.port}/ping", timeout=5).text == "pong"
    finally:
        server.close()
