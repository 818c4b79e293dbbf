"""Flask app factory of the registry's admin API: one blueprint, JSON errors everywhere."""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask, Response, jsonify
from werkzeug.exceptions import HTTPException

from registry.admin_api import API_KEY_CONFIG, STORE_EXTENSION, admin, json_error
from registry.metrics import ADMIN_REQUESTS
from registry.store import RegistryStore
from services.common.errors import TesseraError

log = logging.getLogger(__name__)


def error_body(exc: TesseraError) -> dict[str, Any]:
    """The admin API's JSON error object (admin_api.json_error's shape), for the HTTP server's own refusals."""
    return {"error": {"message": exc.message, "type": exc.error_type, "code": exc.http_status}}


def _tessera_error(exc: TesseraError) -> tuple[Response, int]:
    return json_error(exc.http_status, exc.message, exc.error_type)


def _http_error(exc: HTTPException) -> tuple[Response, int]:
    status = exc.code or 500
    return json_error(status, exc.description or exc.name, "invalid_request_error" if status < 500 else "internal_error")


def _unexpected_error(exc: Exception) -> tuple[Response, int]:
    log.exception("unhandled error in admin API")
    return json_error(500, "internal error", "internal_error")


def _count_request(response: Response) -> Response:
    ADMIN_REQUESTS.labels(status=str(response.status_code)).inc()
    return response


def create_admin_app(store: RegistryStore, api_key: str) -> Flask:
    if not api_key:
        raise ValueError("the admin API needs a non-empty API key")
    app = Flask("tessera.registry")
    app.config[API_KEY_CONFIG] = api_key
    app.extensions[STORE_EXTENSION] = store
    app.register_blueprint(admin)
    app.register_error_handler(TesseraError, _tessera_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _unexpected_error)
    app.after_request(_count_request)

    @app.get("/healthz")
    def healthz() -> Response:
        return jsonify({"status": "ok"})

    return app
