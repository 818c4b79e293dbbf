"""The gateway's Flask app factory: the OpenAI blueprint, /healthz, API keys, errors, metrics."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from flask import Flask, Response, jsonify, request

from services.common.config import GatewayConfig
from services.common.errors import Unauthenticated

from gateway import openai_api
from gateway.bridge import CoreBridge
from gateway.http_errors import register_error_handlers
from gateway.metrics import REQUESTS


def create_app(core: CoreBridge, config: GatewayConfig) -> Flask:
    app = Flask("gateway")
    app.json.sort_keys = False  # keep OpenAI's field order (id, object, created, ...)
    app.extensions[openai_api.CORE_KEY] = core
    app.extensions[openai_api.CONFIG_KEY] = config
    app.register_blueprint(openai_api.bp)
    app.add_url_rule("/healthz", "healthz", _healthz)
    if config.api_keys:
        app.before_request(_require_api_key(config.api_keys))
    app.after_request(_count_request)
    register_error_handlers(app)
    return app


def _healthz() -> Response:
    return jsonify({"status": "ok"})


def _require_api_key(keys: list[str]) -> Callable[[], None]:
    accepted = [k.encode() for k in keys]

    def check() -> None:
        if request.endpoint == "healthz":
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        given = token.strip().encode()
        # compare_digest on every key: the time taken says nothing about which prefix matched.
        if scheme.lower() != "bearer" or not any([hmac.compare_digest(given, k) for k in accepted]):
            raise Unauthenticated("a valid API key is required: send 'Authorization: Bearer <key>'")

    return check


def _count_request(response: Response) -> Response:
    route = request.url_rule.rule if request.url_rule is not None else "unmatched"
    REQUESTS.labels(route=route, status=str(response.status_code)).inc()
    return response
