"""The Flask apps' HTTP server (the gateway's REST API, the registry's admin API): LoopHttpServer,
uvicorn on the role's event loop serving the app through FlaskAsgi."""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import logging
import resource
from typing import Any

import uvicorn
from flask import Flask
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from services.common.errors import Unavailable
from services.common.flask_asgi import ErrorBody, FlaskAsgi

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class HttpLimits:
    """What clients may hold of a LoopHttpServer. Past a limit a client gets a clear answer or a
    closed connection, never a wait in the kernel's accept queue."""

    max_connections: int = 10_000  # open at once; the next ones get 503 + Retry-After
    header_timeout_s: float = 10.0  # a request line and its headers must arrive within this
    body_timeout_s: float = 60.0  # ... and its body within this: 408
    keep_alive_s: float = 15.0  # an idle kept-alive connection is closed after this
    write_stall_s: float = 60.0  # a client that reads nothing of its answer for this long is dropped
    max_body_bytes: int = 64 * 1024 * 1024  # larger: 413
    shutdown_grace_s: float = 5.0  # answers still streaming at close() are cancelled after this


class LoopHttpServer:
    """uvicorn's HTTP/1.1 server (httptools) on the running event loop, serving a Flask app through
    FlaskAsgi: connections and streamed answers live on the loop (no thread each); handlers run on
    the adapter's thread pool. Start with `await LoopHttpServer.start(...)`; port 0 picks a free one."""

    def __init__(self, listener: asyncio.Server, state: ServerState, app: FlaskAsgi, grace_s: float) -> None:
        self._listener = listener
        self._state = state  # uvicorn's: open connections, running request tasks, default headers
        self._app = app
        self._grace_s = grace_s
        self._clock = asyncio.create_task(self._keep_date_header())
        self.port: int = listener.sockets[0].getsockname()[1]

    @classmethod
    async def start(cls, flask_app: Flask, host: str, port: int, *, threads: int, limits: HttpLimits,
                    error_body: ErrorBody) -> LoopHttpServer:
        """Serve `flask_app` with `threads` handler threads; `error_body` renders the server's own
        refusals (413, 408, 503 over capacity) in the app's JSON error shape."""
        app = FlaskAsgi(flask_app, threads, limits.max_body_bytes, limits.body_timeout_s, error_body)
        max_connections = min(limits.max_connections, _connections_the_fd_limit_allows())
        config = uvicorn.Config(app, interface="asgi3", lifespan="off", ws="none", log_config=None, access_log=False,
                                timeout_keep_alive=limits.keep_alive_s)  # type: ignore[arg-type]
        config.load()
        state = ServerState()
        protocol = _guarded_protocol(app, limits, max_connections)
        loop = asyncio.get_running_loop()
        listener = await loop.create_server(
            lambda: protocol(config=config, server_state=state, app_state={}, _loop=loop), host, port, backlog=2048)
        log.info("HTTP server listening on %s:%d", host, listener.sockets[0].getsockname()[1])
        return cls(listener, state, app, limits.shutdown_grace_s)

    async def close(self) -> None:
        """Stop listening, close idle connections, give answers in progress the grace time, cancel the rest."""
        self._listener.close()
        self._clock.cancel()
        for connection in list(self._state.connections):
            connection.shutdown()  # idle: closed now; busy: closed after its answer
        deadline = asyncio.get_running_loop().time() + self._grace_s
        while self._state.tasks and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for task in list(self._state.tasks):
            task.cancel()
        for connection in list(self._state.connections):
            connection.transport.close()
        self._app.close()

    async def _keep_date_header(self) -> None:
        while True:
            self._state.default_headers = [(b"date", email.utils.formatdate(usegmt=True).encode())]
            await asyncio.sleep(1.0)


def _guarded_protocol(app: FlaskAsgi, limits: HttpLimits, max_connections: int) -> type[HttpToolsProtocol]:
    """uvicorn's protocol with what it lacks for public traffic: a connection cap answered at once,
    a deadline for each request's headers (a fresh connection that sends nothing included; between
    requests uvicorn's keep-alive timeout closes idle ones), and a deadline for a stalled reader."""
    retry_after_s = 1.0

    async def over_capacity(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await app.answer_error(send, Unavailable(
            f"the server holds its maximum of {max_connections} connections; retry", retry_after_s=retry_after_s))

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _headers_deadline: asyncio.TimerHandle | None = None
        _write_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.app = over_capacity  # every request on this connection; then it closes
            self._await_headers()

        def on_message_begin(self) -> None:  # the first bytes of a request (the first is awaited since connect)
            super().on_message_begin()
            if self._headers_deadline is None:
                self._await_headers()

        def on_headers_complete(self) -> None:
            self._cancel("_headers_deadline")
            super().on_headers_complete()

        def pause_writing(self) -> None:
            super().pause_writing()
            self._write_deadline = self.loop.call_later(limits.write_stall_s, self.transport.close)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._cancel("_write_deadline")

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel("_headers_deadline")
            self._cancel("_write_deadline")
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            self._headers_deadline = self.loop.call_later(limits.header_timeout_s, self.transport.close)

        def _cancel(self, name: str) -> None:
            timer = getattr(self, name)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

    return GuardedHttpToolsProtocol


def _connections_the_fd_limit_allows() -> int:
    """Raise this process's open-file limit to its hard limit; keep a quarter of it for everything else."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft * 3 // 4 if soft != resource.RLIM_INFINITY else 1 << 20
