"""CoreBridge: GatewayCore's async API reached from Flask's handler threads.

The core lives on the gateway's event loop; Flask handlers run on the HTTP server's small thread
pool (services/common/flask_asgi.py). A quick call is scheduled on the loop with
`run_coroutine_threadsafe` and waited for; a generation or a classification is started by a
LoopResponse on the loop itself, so no thread waits for a worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tessera.v1 import common_pb2, inference_pb2

from gateway.core import GatewayCore

# Beyond the request deadline: a stalled loop must not hang a handler thread forever.
STALL_MARGIN_S = 30.0


class CoreBridge:
    def __init__(self, core: GatewayCore, loop: asyncio.AbstractEventLoop, request_timeout_s: float) -> None:
        self._core = core
        self._loop = loop
        self._wait_s = request_timeout_s + STALL_MARGIN_S

    def list_models(self) -> list[inference_pb2.ModelCard]:
        future = asyncio.run_coroutine_threadsafe(self._core.list_models(), self._loop)
        return future.result(timeout=self._wait_s)

    def generate(self, request: inference_pb2.GenerateRequest) -> AsyncIterator[common_pb2.GenerateResponse]:
        """The core's stream, not started: iterate it on the loop (closing it cancels the worker call)."""
        return self._core.generate(request)

    async def classify(self, request: inference_pb2.ClassifyRequest) -> inference_pb2.ClassifyResponse:
        """Await on the loop (a LoopResponse's)."""
        return await self._core.classify(request)
