"""Client API keys (`gateway.api_keys`), one check for both front doors.

REST sends `Authorization: Bearer <key>`; gRPC the same value as `authorization` metadata
(`ApiKeyInterceptor`). Every configured key is compared, each in constant time, on SHA-256
digests, so neither which key nearly matched nor a key's length shows in the time taken.
The open endpoints: REST /healthz and /openapi.json, gRPC's standard grpc.health.v1.Health
(orchestrators probe them without a key).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator, Sequence

import grpc

from services.common.errors import Unauthenticated

OPEN_GRPC_SERVICES = ("grpc.health.v1.Health",)
# Each door names its own way to send the key.
MISSING_KEY = "a valid API key is required: send the header 'Authorization: Bearer <key>'"
MISSING_KEY_GRPC = "a valid API key is required: send the metadata 'authorization: Bearer <key>'"


class ApiKeys:
    def __init__(self, keys: Sequence[str]) -> None:
        assert keys, "an empty list means the API is open: install no check at all"
        self._digests = [_digest(key) for key in keys]

    def accepts(self, authorization: str | None) -> bool:
        """`authorization`: the header's value, "Bearer <key>"."""
        scheme, _, token = (authorization or "").partition(" ")
        given = _digest(token.strip())
        matches = [hmac.compare_digest(given, digest) for digest in self._digests]  # all of them, always
        return scheme.lower() == "bearer" and any(matches)

    def check(self, authorization: str | None) -> None:
        if not self.accepts(authorization):
            raise Unauthenticated(MISSING_KEY)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without an accepted key (its request is never parsed); the
    health service stays open."""

    def __init__(self, keys: ApiKeys) -> None:
        self._keys = keys

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").partition("/")[0]
        if handler is None or service in OPEN_GRPC_SERVICES:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        authorization = metadata.get("authorization")
        if isinstance(authorization, str) and self._keys.accepts(authorization):
            return handler
        return _refusing(handler)


async def _refuse(request: bytes, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MISSING_KEY_GRPC)


async def _refuse_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MISSING_KEY_GRPC)
    yield  # an async generator, as a server-streaming handler must be


# (request streaming, response streaming) -> the handler factory and the refusal for that shape
_SHAPES = {
    (False, False): (grpc.unary_unary_rpc_method_handler, _refuse),
    (False, True): (grpc.unary_stream_rpc_method_handler, _refuse_stream),
    (True, False): (grpc.stream_unary_rpc_method_handler, _refuse),
    (True, True): (grpc.stream_stream_rpc_method_handler, _refuse_stream),
}


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s shape that refuses every call without parsing its request."""
    make, refuse = _SHAPES[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, response_serializer=handler.response_serializer)
