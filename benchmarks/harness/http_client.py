"""The raw HTTP/1.1 client the load benchmarks share: one request a connection on asyncio, with no
client library between the timer and the socket (thousands of streams at once, on the loop).

    request = post_json(port, "/v1/completions", {"model": "m", "prompt": "p", "stream": True})
    error = await exchange(port, request, read, timeout_s)   # read(reader) parses the answer
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable


def post_json(port: int, path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


async def exchange(port: int, request: bytes, read: Callable[[asyncio.StreamReader], Awaitable[None]],
                   timeout_s: float, sent: Callable[[], None] = lambda: None) -> str:
    """Send `request` on a new connection (`sent()` once it is written), then `read(reader)` the
    answer within `timeout_s`; -> "" or what went wrong on the way."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        return f"connect: {exc}"
    try:
        async def send_then_read() -> None:
            writer.write(request)
            await writer.drain()
            sent()
            await read(reader)

        await asyncio.wait_for(send_then_read(), timeout_s)
        return ""
    except (asyncio.TimeoutError, OSError, ValueError, IndexError, asyncio.IncompleteReadError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        writer.close()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status line and headers (names lower-cased)."""
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """A chunked body's chunks (<hex size>\\r\\n<data>\\r\\n ... 0\\r\\n\\r\\n), each without its CRLF."""
    while size := int((await reader.readline()).strip(), 16):
        yield (await reader.readexactly(size + 2))[:-2]


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    """A whole body, chunked or by Content-Length."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return b"".join([chunk async for chunk in chunks(reader)])
    return await reader.readexactly(int(headers.get("content-length", 0)))
