"""gRPC calls from the gateway to GPU workers: one cached channel per worker address."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from services.common.errors import from_rpc_error
from services.common.tls import aio_channel
from tessera.v1 import common_pb2, worker_pb2, worker_pb2_grpc

# A restarted worker is reachable again within ~2 s instead of gRPC's default two minutes.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


class WorkerClient:
    """Streams generations from workers; failures surface as services.common.errors.

    INVALID_ARGUMENT from a worker (a prompt longer than its context) stays InvalidArgument;
    a worker dying mid-stream (UNAVAILABLE or CANCELLED) becomes Unavailable.
    """

    def __init__(self, request_timeout_s: float, credentials: grpc.ChannelCredentials | None = None) -> None:
        """`credentials`: the gateway's cluster certificate (mutual TLS); None dials plaintext."""
        self._timeout_s = request_timeout_s
        self._credentials = credentials
        self._stubs: dict[str, worker_pb2_grpc.WorkerServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = aio_channel(address, self._credentials, CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[address] = worker_pb2_grpc.WorkerServiceStub(channel)
        return stub

    def generate(self, address: str,
                 request: worker_pb2.WorkerGenerateRequest) -> AsyncIterator[common_pb2.GenerateResponse]:
        stub = self._stub(address)
        return _stream(lambda: stub.Generate(request, timeout=self._timeout_s), address)

    def watch_state(self, address: str, interval_ms: int) -> AsyncIterator[worker_pb2.WorkerState]:
        """The worker's pushed states until the stream ends (no deadline: it lives as long as the worker)."""
        stub = self._stub(address)
        return _stream(lambda: stub.WatchState(worker_pb2.WatchStateRequest(interval_ms=interval_ms)), address)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
        self._stubs.clear()


async def _stream(start: Callable[[], grpc.aio.UnaryStreamCall], address: str) -> AsyncIterator[Any]:
    """A server stream's messages, its errors as Tessera errors. The call starts on the first
    iteration; closing this generator early (the client went away, the gateway shut down) cancels
    it, which stops the worker's work."""
    call = start()
    try:
        async for message in call:
            yield message
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, f"worker {address}") from None
    finally:
        call.cancel()
