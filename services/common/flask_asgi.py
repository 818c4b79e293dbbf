"""A Flask app behind an ASGI server: handlers on a small thread pool, long answers on the event loop.

A Flask handler runs on one of `threads` threads for what is quick and blocking (parsing, checking,
a database query) and answers as usual. An answer that waits on the event loop's work (a stream of
generated tokens, seconds or minutes) is a `LoopResponse` instead: the handler returns it at once,
its thread goes back to the pool, and the server produces the answer on the loop, so a thousand
streams hold a thousand small tasks, not a thousand threads:

    @bp.post("/v1/chat/completions")
    def chat() -> Response:
        request = parse(flask.request)                   # on a pool thread
        return LoopResponse(answer(request)).flask()     # answer(): an async generator, run on the loop

    async def answer(request) -> AsyncIterator[Head | bytes]:
        first = await core.first_token(request)          # errors here still choose the status
        yield Head(200, [("Content-Type", "text/event-stream")])
        yield b"data: ...\\n\\n"                           # each chunk sent as it comes

A client that goes away mid-answer cancels it (and what it awaits). Requests are read whole before
the handler runs, within a size and a time limit, so a slow client never holds a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flask import Flask, Response

from services.common.errors import Internal, PayloadTooLarge, RequestTimeout, TesseraError

log = logging.getLogger(__name__)

# ASGI's types, kept loose: the server hands plain dicts.
Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]
ErrorBody = Callable[[TesseraError], dict[str, Any]]


@dataclasses.dataclass(frozen=True, slots=True)
class Head:
    """A response's status line and headers: the first item a LoopResponse yields."""

    status: int
    headers: list[tuple[str, str]]


class LoopResponse:
    """An answer made on the event loop: `parts` yields one Head, then the body's chunks.

    It replaces the Flask response's status and headers entirely; Flask's after-request hooks see a
    placeholder 200 (check `is_loop_response`)."""

    def __init__(self, parts: AsyncIterator[Head | bytes]) -> None:
        self.parts = parts

    def flask(self) -> Response:
        # direct_passthrough: werkzeug hands this object itself to the server as the WSGI body.
        return Response(self, direct_passthrough=True)

    def __iter__(self) -> Iterator[bytes]:
        raise TypeError("a LoopResponse is answered on the event loop by FlaskAsgi; a WSGI server cannot serve it")


def is_loop_response(response: Response) -> bool:
    return isinstance(response.response, LoopResponse)


class FlaskAsgi:
    """The ASGI app serving `app`: see the module docstring."""

    def __init__(self, app: Flask, threads: int, max_body_bytes: int, body_timeout_s: float,
                 error_body: ErrorBody) -> None:
        self._app = app
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="http")
        self._max_body_bytes = max_body_bytes
        self._body_timeout_s = body_timeout_s
        self._error_body = error_body

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http", "the server runs without lifespan or websockets"
        try:
            body = await asyncio.wait_for(self._read_body(scope, receive), self._body_timeout_s)
        except asyncio.TimeoutError:
            await self.answer_error(send, RequestTimeout(
                f"the request body did not arrive within {self._body_timeout_s:.0f} s"))
            return
        except PayloadTooLarge as exc:
            await self.answer_error(send, exc)
            return
        environ = _wsgi_environ(scope, body)
        status, headers, answer = await asyncio.get_running_loop().run_in_executor(self._pool, self._handle, environ)
        if isinstance(answer, LoopResponse):
            await self._answer_on_loop(answer, receive, send)
            return
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    async def answer_error(self, send: Send, exc: TesseraError) -> None:
        """`exc` as a whole JSON error response; the connection closes after it."""
        body = json.dumps(self._error_body(exc)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        if (retry_after := exc.retry_after_header()) is not None:
            headers.append((b"retry-after", retry_after.encode()))
        await send({"type": "http.response.start", "status": exc.http_status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self._max_body_bytes:
            raise PayloadTooLarge(f"the request body is {int(declared)} bytes; at most {self._max_body_bytes} are accepted")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self._max_body_bytes:
                raise PayloadTooLarge(f"the request body exceeds {self._max_body_bytes} bytes")
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    def _handle(self, environ: dict[str, Any]) -> tuple[int, list[tuple[bytes, bytes]], bytes | LoopResponse]:
        """On a pool thread: Flask's answer, its body read whole unless it is a LoopResponse."""
        head: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
            head[:] = [int(status.split(" ", 1)[0]), [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                                     for k, v in headers]]
            return _no_write

        body = self._app(environ, start_response)
        if isinstance(body, LoopResponse):
            return 0, [], body
        try:
            return head[0], head[1], b"".join(body)
        finally:
            if hasattr(body, "close"):
                body.close()

    async def _answer_on_loop(self, answer: LoopResponse, receive: Receive, send: Send) -> None:
        """Relay `answer` until it ends or the client goes away (which cancels it)."""
        relay = asyncio.ensure_future(self._relay(answer, send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not relay.done():
                relay.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await relay
        if not relay.cancelled():
            relay.result()

    async def _relay(self, answer: LoopResponse, send: Send) -> None:
        async with contextlib.aclosing(answer.parts) as parts:  # type: ignore[type-var]
            try:
                head = await anext(parts)
            except Exception as exc:  # the answer's own errors choose their status; this is a bug
                log.exception("a LoopResponse failed before its head")
                await self.answer_error(send, exc if isinstance(exc, TesseraError)
                                        else Internal(f"internal error: {type(exc).__name__}"))
                return
            assert isinstance(head, Head), f"a LoopResponse yields its Head first, got {type(head).__name__}"
            await send({"type": "http.response.start", "status": head.status,
                        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in head.headers]})
            async for chunk in parts:
                assert isinstance(chunk, bytes), f"after its Head a LoopResponse yields bytes, got {type(chunk).__name__}"
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def _no_write(data: bytes) -> None:
    raise NotImplementedError("the WSGI write() callable is not supported: return the body")


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (or the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _wsgi_environ(scope: Scope, body: bytes) -> dict[str, Any]:
    """PEP 3333's environ of an ASGI HTTP scope; strings carry the raw bytes as latin-1."""
    server_host, server_port = scope.get("server") or ("localhost", 80)
    environ: dict[str, Any] = {
        "REQUEST_METHOD": scope["method"],
        "SCRIPT_NAME": scope.get("root_path", "").encode().decode("latin-1"),
        "PATH_INFO": scope["path"].encode().decode("latin-1"),
        "QUERY_STRING": scope["query_string"].decode("latin-1"),
        "SERVER_NAME": str(server_host),
        "SERVER_PORT": str(server_port),
        "SERVER_PROTOCOL": f"HTTP/{scope['http_version']}",
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": io.BytesIO(body),
        "wsgi.input_terminated": True,  # whole: werkzeug reads it whatever Transfer-Encoding said
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    if scope.get("client"):
        environ["REMOTE_ADDR"], environ["REMOTE_PORT"] = scope["client"][0], str(scope["client"][1])
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin-1").upper().replace("-", "_")
        if name == "CONTENT_LENGTH":
            continue  # the body was read whole: its real length is above
        key = name if name == "CONTENT_TYPE" else f"HTTP_{name}"
        value = raw_value.decode("latin-1")
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    return environ
