"""The gateway's Flask app factory: the OpenAI blueprint, /healthz, /openapi.json, API keys, errors, metrics."""

from __future__ import annotations

import math
from collections.abc import Callable

from flask import Flask, Response, jsonify, request

from services.common.config import GatewayConfig
from services.common.flask_asgi import is_loop_response
from services.common.http_server import HttpLimits, LoopHttpServer

from gateway import openai_api
from gateway.api_keys import ApiKeys
from gateway.bridge import CoreBridge
from gateway.http_errors import error_body, register_error_handlers
from gateway.metrics import REQUESTS
from gateway.openapi import openapi_document

OPEN_ENDPOINTS = frozenset({"healthz", "openapi"})  # no key needed: probes, and the API's description


async def start_http_server(core: CoreBridge, config: GatewayConfig) -> LoopHttpServer:
    """The REST API on the running loop (streams hold no thread), within limits that fit its requests."""
    # The largest valid body: every image at its limit, base64 (4/3), and a prompt of escaped characters.
    max_body_bytes = (math.ceil(config.max_images_per_request * config.max_image_bytes * 4 / 3)
                      + 6 * config.max_prompt_chars + 1024 * 1024)
    return await LoopHttpServer.start(create_app(core, config), config.host, config.http_port,
                                      threads=config.http_threads, error_body=error_body,
                                      limits=HttpLimits(max_body_bytes=max_body_bytes))


def create_app(core: CoreBridge, config: GatewayConfig) -> Flask:
    app = Flask("gateway")
    app.json.sort_keys = False  # keep OpenAI's field order (id, object, created, ...)
    app.extensions[openai_api.CORE_KEY] = core
    app.extensions[openai_api.CONFIG_KEY] = config
    app.register_blueprint(openai_api.bp)
    app.add_url_rule("/healthz", "healthz", _healthz)
    document = openapi_document(config)
    app.add_url_rule("/openapi.json", "openapi", lambda: jsonify(document))
    if config.api_keys:
        app.before_request(_require_api_key(ApiKeys(config.api_keys)))
    app.after_request(_count_request)
    register_error_handlers(app)
    return app


def _healthz() -> Response:
    return jsonify({"status": "ok"})


def _require_api_key(keys: ApiKeys) -> Callable[[], None]:
    def check() -> None:
        if request.endpoint not in OPEN_ENDPOINTS:
            keys.check(request.headers.get("Authorization"))

    return check


def _count_request(response: Response) -> Response:
    if is_loop_response(response):  # its status is not known yet: openai_api counts it when it is
        return response
    route = request.url_rule.rule if request.url_rule is not None else "unmatched"
    REQUESTS.labels(route=route, status=str(response.status_code)).inc()
    return response
