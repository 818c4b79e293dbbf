"""A local HTTP server for remote image URL tests: images, a 404, redirects, oversized and slow answers.

    with ImageServer({"/cat.png": PNG}) as server:
        server.url("/cat.png")  # http://127.0.0.1:<port>/cat.png
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

SLOW_S = 3.0  # how long /slow waits before answering; tests time out well before


class ImageServer:
    """Routes (besides the files given):
    /redirect?to=LOCATION   302 to LOCATION (relative or absolute); /loop redirects to itself
    /missing                404
    /unsized?bytes=N        N bytes, no Content-Length (the body ends when the connection closes)
    /sized?bytes=N          Content-Length: N, then only its first byte (a refusal must not wait for the rest)
    /slow                   answers after SLOW_S
    /drip                   a 200 whose body comes one byte every 0.1 s for SLOW_S (each read is quick)
    """

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.paths: list[str] = []  # every request's path, in order
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                server.paths.append(self.path)
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                try:
                    server._answer(self, url.path, query)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the gateway gave up on this answer, as it should

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def __enter__(self) -> ImageServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _answer(self, handler: BaseHTTPRequestHandler, path: str, query: dict[str, str]) -> None:
        if path in self.files:
            self._send(handler, 200, self.files[path], length=len(self.files[path]))
        elif path in ("/redirect", "/loop"):
            handler.send_response(302)
            handler.send_header("Location", query.get("to", "/loop"))
            handler.send_header("Content-Length", "0")
            handler.end_headers()
        elif path == "/unsized":
            self._send(handler, 200, b"\x89PNG" + b"x" * (int(query["bytes"]) - 4), length=None)
        elif path == "/sized":
            self._send(handler, 200, b"\x89", length=int(query["bytes"]))
        elif path == "/slow":
            time.sleep(SLOW_S)
            self._send(handler, 200, self.files["/cat.png"], length=len(self.files["/cat.png"]))
        elif path == "/drip":
            handler.send_response(200)
            handler.end_headers()
            for _ in range(int(SLOW_S / 0.1)):
                handler.wfile.write(b"x")
                handler.wfile.flush()
                time.sleep(0.1)
        else:
            self._send(handler, 404, b"not found", length=9)

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, body: bytes, length: int | None) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/octet-stream")
        if length is not None:
            handler.send_header("Content-Length", str(length))
        handler.end_headers()
        handler.wfile.write(body)
