"""grpc.aio server construction shared by every role: error mapping, health, shutdown."""

from __future__ import annotations

import dataclasses
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
# grpc.aio hands a new call to Python only when the event loop asks core for the next one, so a
# burst of calls waits in core's pending-call queue. Past its soft limit (gRPC's default 1,000) core
# drops arriving calls at random, past its hard limit (3,000) all of them, each as a bare CANCELLED:
# 2,000 streams sent at once to a worker lost ~10%. The queue only absorbs a burst; overload is
# refused by the gateway's admission (RESOURCE_EXHAUSTED / 429 with Retry-After), not here.
MAX_PENDING_CALLS = 10_000


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, TesseraError):
        if (retry_after := exc.retry_after_header()) is not None:
            # The same whole seconds as HTTP's Retry-After, and as gRPC's own pushback, which
            # clients with a retry policy honour.
            context.set_trailing_metadata((("retry-after", retry_after),
                                           ("grpc-retry-pushback-ms", str(int(retry_after) * 1000))))
        await context.abort(exc.grpc_code, exc.message)
    log.exception("unhandled error in gRPC handler")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


@dataclasses.dataclass(frozen=True, slots=True)
class _Unparsed:
    """A request message that did not parse, e.g. a string field holding invalid UTF-8."""

    error: str


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """The request's parser, returning _Unparsed instead of raising: a raising deserializer is
    UNKNOWN plus a logged traceback in grpc; bad bytes are the client's INVALID_ARGUMENT."""
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError for protobuf; any parser's failure is about the bytes
            return _Unparsed(str(exc))

    return deserialize


async def _refuse_unparsed(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Unparsed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request message does not parse: {request.error}")


def _wrap_unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse_unparsed(request, context)
        try:
            return await fn(request, context)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc)

    return handler


def _wrap_stream(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _refuse_unparsed(request, context)
        try:
            async for item in fn(request, context):
                yield item
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc)

    return handler


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps TesseraError subclasses to their status codes, a request that does not parse to
    INVALID_ARGUMENT; anything else is INTERNAL (and logged)."""

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            _wrap_unary(handler.unary_unary),
            request_deserializer=_lenient(handler.request_deserializer),
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


async def start_grpc_server(address: str, registrar: Registrar, service_names: Sequence[str],
                            credentials: grpc.ServerCredentials | None = None, *,
                            interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> GrpcServer:
    """Bind `address` ("host:port"; port 0 picks a free one), register servicers, start.

    `credentials`: TLS (services/common/tls.py: the registry and workers require a cluster client
    certificate); None serves plaintext. `interceptors` run first, before the error mapping (e.g.
    the gateway's API-key check).
    """
    server = grpc.aio.server(
        interceptors=[*interceptors, ErrorMappingInterceptor()],
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
        ],
    )
    registrar(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    await server.start()
    wrapped = GrpcServer(server, health_servicer, service_names, port)
    await wrapped.set_serving(True)
    log.info("gRPC server listening on %s (port %d, %s)", address, port,
             "plaintext" if credentials is None else "TLS")
    return wrapped


def check_health(address: str, timeout_s: float = 1.0, service: str = "",
                 credentials: grpc.ChannelCredentials | None = None) -> bool:
    """True if the gRPC server at `address` answers SERVING (blocking; for launchers and tests).

    `credentials`: what the server requires (tls.health_probe_credentials); None dials plaintext."""
    return health_status(address, timeout_s, service, credentials) == "SERVING"


def health_status(address: str, timeout_s: float = 1.0, service: str = "",
                  credentials: grpc.ChannelCredentials | None = None) -> str:
    """What the server at `address` says of `service`: "SERVING", "NOT_SERVING", ...; or, where no
    server answered (nothing listens, a TLS mismatch, the timeout), "unreachable: <gRPC's reason>"."""
    try:
        channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = (exc.details() if hasattr(exc, "details") else "") or ""
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return f"unreachable: {code.name}: {details}".rstrip(": ")
        return f"NOT_SERVING ({code.name}: {details})"
