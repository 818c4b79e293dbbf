"""Streaming completions through the gateway's REST port, as a client of the live system sends them
(one request a connection, on the harness's raw HTTP client): what was asked, and what came back.

    result = await rest_stream(port, Request("r1", word_prompt(1, 128), "demo-r8", 16), timeout_s=60)
    result.done, result.ttft_s, result.tokens
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from benchmarks.harness.http_client import chunks, exchange, post_json, read_head


@dataclasses.dataclass(frozen=True)
class Request:
    request_id: str
    prompt: str
    model: str           # the base model or an adapter's name
    max_tokens: int


@dataclasses.dataclass
class Result:
    ttft_s: float | None = None
    tokens: int = 0
    done: bool = False
    error: str = ""


async def rest_stream(port: int, request: Request, timeout_s: float) -> Result:
    """One streaming completion (temperature 0, the usage chunk asked for) on a new connection: chunked
    SSE read to `data: [DONE]`; TTFT from the request written to the first event with text."""
    message = post_json(port, "/v1/completions", {
        "model": request.model, "prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    out = Result()
    sent_at = 0.0

    def sent() -> None:
        nonlocal sent_at
        sent_at = time.perf_counter()

    async def read(reader: asyncio.StreamReader) -> None:
        status, headers = await read_head(reader)
        if status != 200 or headers.get("transfer-encoding") != "chunked":
            out.error = f"HTTP {status}: {(await reader.read(300)).decode(errors='replace')}"
            return
        pending = b""
        async for chunk in chunks(reader):
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                data = event.removeprefix(b"data: ")
                if data == b"[DONE]":
                    out.done = not out.error
                    continue
                body = json.loads(data)
                if "error" in body:
                    out.error = json.dumps(body["error"])[:200]
                elif body.get("usage"):
                    out.tokens = body["usage"]["completion_tokens"]
                elif out.ttft_s is None and any(c.get("text") for c in body.get("choices", ())):
                    out.ttft_s = time.perf_counter() - sent_at

    failure = await exchange(port, message, read, timeout_s, sent)
    out.error = out.error or failure
    return out
