"""grpc.aio server construction shared by every role: error mapping, health, shutdown."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.errors import TesseraError

log = logging.getLogger(__name__)

# A function that adds servicers to a server, e.g. `lambda s: add_FooServicer_to_server(foo, s)`.
Registrar = Callable[[grpc.aio.Server], None]

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, TesseraError):
        if exc.retry_after_s is not None:
            context.set_trailing_metadata((("retry-after", f"{exc.retry_after_s:.3f}"),))
        await context.abort(exc.grpc_code, exc.message)
    log.exception("unhandled error in gRPC handler")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


def _wrap_unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(request, context)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc)

    return handler


def _wrap_stream(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(request, context):
                yield item
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc)

    return handler


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps TesseraError subclasses to their status codes; anything else is INTERNAL (and logged)."""

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            _wrap_unary(handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class GrpcServer:
    """A started grpc.aio server with the standard health service.

    `service_names` are the fully-qualified services reported SERVING (plus ""
    for the whole server); `set_serving(False)` flips them all before shutdown
    so load balancers drain the server first.
    """

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                 service_names: Sequence[str], port: int) -> None:
        self.server = server
        self.health = health_servicer
        self.service_names = list(service_names)
        self.port = port

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)


async def start_grpc_server(address: str, registrar: Registrar, service_names: Sequence[str]) -> GrpcServer:
    """Bind `address` ("host:port"; port 0 picks a free one), register servicers, start."""
    server = grpc.aio.server(
        interceptors=[ErrorMappingInterceptor()],
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    registrar(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    await server.start()
    wrapped = GrpcServer(server, health_servicer, service_names, port)
    await wrapped.set_serving(True)
    log.info("gRPC server listening on %s (port %d)", address, port)
    return wrapped


def check_health(address: str, timeout_s: float = 1.0, service: str = "") -> bool:
    """True if the gRPC server at `address` answers SERVING (blocking; for launchers and tests)."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
