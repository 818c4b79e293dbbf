"""Production WSGI serving for the Flask apps (waitress), run beside the asyncio loop."""

from __future__ import annotations

import logging
import threading

from flask import Flask
from waitress import wasyncore
from waitress.server import create_server

log = logging.getLogger(__name__)


class WsgiServer:
    """A waitress server on its own thread; `close()` stops it."""

    def __init__(self, app: Flask, host: str, port: int, threads: int) -> None:
        # channel_timeout bounds idle keep-alive sockets; long SSE streams keep writing.
        self._server = create_server(app, host=host, port=port, threads=threads,
                                     channel_timeout=300, ident="tessera")
        self.port = int(self._server.effective_port)  # type: ignore[union-attr]  # waitress reports a str
        self._thread = threading.Thread(target=self._server.run, name=f"wsgi-{port}", daemon=True)

    def start(self) -> "WsgiServer":
        self._thread.start()
        log.info("HTTP server listening on %s:%d", self._server.effective_host, self.port)  # type: ignore[union-attr]
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        # Closing sockets from this thread would race the server loop's select()
        # (EBADF); close them on the loop thread, whose loop then ends, and join it.
        server = self._server
        trigger = server.trigger  # type: ignore[union-attr]
        try:
            if trigger._closed:  # its fd number may belong to another file by now: never write to it
                raise OSError("trigger closed")
            trigger.pull_trigger(lambda: wasyncore.close_all(server._map))  # type: ignore[union-attr]
        except OSError:  # the trigger is closed, so the loop has ended: nothing races a close from here
            wasyncore.close_all(server._map)  # type: ignore[union-attr]
        self._thread.join(timeout_s)
        server.task_dispatcher.shutdown()  # type: ignore[union-attr]

