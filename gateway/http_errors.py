"""The one JSON error shape of the REST API, OpenAI's: {"error": {message, type, param, code}}."""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask, Response, jsonify
from werkzeug.exceptions import HTTPException

from services.common.errors import Internal, TesseraError

log = logging.getLogger(__name__)


def error_body(exc: TesseraError) -> dict[str, Any]:
    """Also the payload of an SSE error event, which the openai client raises as APIError."""
    return {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param,
                      "code": exc.grpc_code.name.lower()}}


def error_response(exc: TesseraError) -> Response:
    response = jsonify(error_body(exc))
    response.status_code = exc.http_status
    if (retry_after := exc.retry_after_header()) is not None:  # 429 and 503; gRPC sends the same
        response.headers["Retry-After"] = retry_after
    return response


def _http_exception(exc: HTTPException) -> Response:
    """Unknown route, wrong method, ...: same JSON shape with werkzeug's status."""
    response = jsonify({"error": {"message": exc.description, "type": "invalid_request_error", "param": None,
                                  "code": (exc.name or "error").lower().replace(" ", "_")}})
    response.status_code = exc.code or 500
    for name, value in exc.get_headers():  # e.g. Allow on a 405
        if name.lower() != "content-type":
            response.headers[name] = value
    return response


def _unexpected(exc: Exception) -> Response:
    log.exception("unhandled error in REST handler")
    return error_response(Internal(f"internal error: {type(exc).__name__}"))


def register_error_handlers(app: Flask) -> None:
    app.register_error_handler(TesseraError, error_response)
    app.register_error_handler(HTTPException, _http_exception)
    app.register_error_handler(Exception, _unexpected)
