"""CoreBridge: GatewayCore's async API called from Flask's worker threads.

The core lives on the gateway's event loop; waitress runs Flask handlers on its own threads.
A call is scheduled on the loop with `run_coroutine_threadsafe`; a stream is an async
generator drained by a loop task into a thread-safe queue that the handler thread reads.
Closing the handler's iterator (the HTTP client went away) cancels that task, which cancels
the upstream worker call.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Generator
from typing import Any

from services.common.errors import DeadlineExceeded
from tessera.v1 import common_pb2, inference_pb2

from gateway.core import GatewayCore

# Beyond the worker call's own deadline: a stalled loop must not hang a thread forever.
STALL_MARGIN_S = 30.0

_END = object()


class CoreBridge:
    def __init__(self, core: GatewayCore, loop: asyncio.AbstractEventLoop, request_timeout_s: float) -> None:
        self._core = core
        self._loop = loop
        self._wait_s = request_timeout_s + STALL_MARGIN_S

    def list_models(self) -> list[inference_pb2.ModelCard]:
        future = asyncio.run_coroutine_threadsafe(self._core.list_models(), self._loop)
        return future.result(timeout=self._wait_s)

    def generate(self, request: inference_pb2.GenerateRequest) -> Generator[common_pb2.GenerateResponse, None, None]:
        """The core's stream as a blocking iterator; errors are raised where they occur."""
        items: queue.SimpleQueue[Any] = queue.SimpleQueue()

        async def drain() -> None:
            try:
                async for response in self._core.generate(request):
                    items.put(response)
            except Exception as exc:  # handed to the reading thread, which raises it
                items.put(exc)
            else:
                items.put(_END)

        future = asyncio.run_coroutine_threadsafe(drain(), self._loop)
        try:
            while True:
                try:
                    item = items.get(timeout=self._wait_s)
                except queue.Empty:
                    raise DeadlineExceeded(f"request {request.request_id} stalled for {self._wait_s:.0f} s") from None
                if item is _END:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            future.cancel()  # no-op once drained; otherwise stops the upstream call
