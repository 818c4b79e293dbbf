"""The gateway's REST server under many concurrent SSE streams, and beside many idle connections.

Runs the real system on loopback: `tessera demo-assets` into a temporary TESSERA_HOME, then
`tessera up` (registry, worker, gateway as processes on free ports), the worker's batch limits
raised so that it batches every stream (max_num_seqs, max_batch_tokens, kv_cache_tokens) and the
gateway's admission bound set by --max-in-flight. For each N in --streams it measures:

- direct: N streams of the same request sent at once straight to the worker's gRPC Generate (with
  the gateway's cluster certificate), the worker's time to first token (TTFT) seen from a client;
- gateway: the same N at once as SSE completions (`stream: true`) through the gateway's REST port,
  from raw asyncio sockets: held (a 200 stream with its first token), completed (`data: [DONE]`),
  refused (429, each with a Retry-After), failed (anything else); TTFT p50/p99 (request written ->
  first token's event); the gateway's added latency, its TTFT minus the direct run's at p50 and p99
  (the same load one after the other, so this is the cost of the HTTP server, Flask, the core's
  admission and routing, and one more gRPC hop, under that load; distributions, not pairs: the
  gateway also spreads the worker's arrivals, which can make it negative);
- front: the same request's client TTFT minus the gateway's own (its histogram
  tessera_gateway_time_to_first_token_seconds, admission -> first token back from the worker), as
  means over the run: the HTTP server, the thread hop through Flask and the SSE write, per request;
- unadmitted: how long after the last request was written the gateway had decided every one
  (admitted, by its in-flight gauge, or answered 429), and the longest queue of connections the
  kernel held for it to accept (the listening socket's accept queue, sampled every 10 ms).

Then --idle TCP connections are opened (each sends half a request line and nothing more) and a
normal request (GET /v1/models on a new connection) is timed, median of 20, with and without them.
The load client runs in this process, on the same cores as the system.

    PYTHONPATH=.:protos python3 -m benchmarks.gateway_load --streams 100 500 2000 --idle 500 [--json OUT] [--log OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from benchmarks.harness.cli import exits_on_sigterm, suite_parser
from benchmarks.harness.http_client import chunks, exchange, post_json, read_body, read_head
from benchmarks.harness.live_system import DEMO_MODELS, RunningSystem, run_cli, system_env, tessera_up
from benchmarks.harness.report import percentile, write_json
from services.common.tls import load_role_credentials
from services.demo_assets import DEMO_BASE_MODEL
from tessera.v1 import common_pb2, worker_pb2, worker_pb2_grpc

PROMPT = "def fibonacci(n):"
IDLE_PROBE = b"POST /v1/completions HT"  # half a request line: the connection is open and says nothing more


@dataclasses.dataclass(slots=True)
class Stream:
    """One client's view of one request."""

    sent_at: float = 0.0  # perf_counter when the request was written
    status: int = 0
    retry_after: str | None = None
    ttft_s: float | None = None  # request written -> first token's event (or 429's head)
    done: bool = False  # the stream ended with data: [DONE]
    done_s: float | None = None  # request written -> data: [DONE]
    error: str = ""


@dataclasses.dataclass(slots=True)
class LoadRun:
    streams: list[Stream]
    all_decided_s: float | None  # last request written -> every request admitted or refused
    max_accept_queue: int  # connections waiting for the gateway to accept them, at most
    gateway_ttft_mean_s: float | None  # the gateway's own TTFT histogram over this run (admission -> first token)

    @property
    def held(self) -> int:
        return sum(s.status == 200 and s.ttft_s is not None for s in self.streams)

    @property
    def completed(self) -> int:
        return sum(s.done for s in self.streams)

    @property
    def refused(self) -> int:
        return sum(s.status == 429 for s in self.streams)

    @property
    def failed(self) -> list[Stream]:
        return [s for s in self.streams if not s.done and s.status != 429]

    def ttfts(self) -> list[float]:
        return [s.ttft_s for s in self.streams if s.status == 200 and s.ttft_s is not None]


def completion_request(port: int, max_tokens: int) -> bytes:
    return post_json(port, "/v1/completions", {"model": DEMO_BASE_MODEL, "prompt": PROMPT, "max_tokens": max_tokens,
                                               "stream": True, "temperature": 0})


async def sse_stream(port: int, request: bytes, timeout_s: float) -> Stream:
    """Send `request` on a new connection and read its answer (chunked SSE or a whole error)."""
    out = Stream()

    def sent() -> None:
        out.sent_at = time.perf_counter()

    async def read(reader: asyncio.StreamReader) -> None:
        out.status, headers = await read_head(reader)
        out.retry_after = headers.get("retry-after")
        if out.status != 200:
            out.ttft_s = time.perf_counter() - out.sent_at
            if out.status != 429:  # say why it failed
                out.error = f"{out.status}: " + (await read_body(reader, headers)).decode(errors="replace")[:200]
            return
        async for data in chunks(reader):
            if out.ttft_s is None and data.startswith(b"data: {"):
                out.ttft_s = time.perf_counter() - out.sent_at
            if b"data: [DONE]" in data:
                out.done, out.done_s = True, time.perf_counter() - out.sent_at
            elif b'data: {"error"' in data:
                out.error = data.decode(errors="replace")[:200]

    failure = await exchange(port, request, read, timeout_s, sent)
    out.error = out.error or failure
    return out


async def gauge(port: int, name: str) -> float | None:
    """One Prometheus gauge from a /metrics page on `port`."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        page = (await reader.read()).decode()
        writer.close()
    except OSError:
        return None
    for line in page.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def accept_queue(port: int) -> int:
    """Connections the kernel holds for the listening socket on `port` (its rx_queue in /proc/net/tcp*)."""
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    total += int(fields[4].split(":")[1], 16)
    return total


async def load(http_port: int, metrics_port: int, n: int, max_tokens: int, timeout_s: float) -> LoadRun:
    """N streams at once through the gateway, watching its accept queue and its in-flight gauge."""
    request = completion_request(http_port, max_tokens)
    stop = asyncio.Event()
    queue_max = 0
    decided_at: float | None = None

    async def watch_queue() -> None:
        nonlocal queue_max
        while not stop.is_set():
            queue_max = max(queue_max, accept_queue(http_port))
            await asyncio.sleep(0.01)

    async def watch_decisions(tasks: list[asyncio.Task[Stream]]) -> None:
        # Decided: admitted (the gateway's in-flight gauge), refused (429) or already finished.
        nonlocal decided_at
        while not stop.is_set():
            in_flight = await gauge(metrics_port, "tessera_gateway_in_flight_requests") or 0
            answered = sum(t.done() and t.result().status in (200, 429) for t in tasks)
            if in_flight + answered >= n:
                decided_at = time.perf_counter()
                return
            await asyncio.sleep(0.02)

    histogram = "tessera_gateway_time_to_first_token_seconds"
    before = [await gauge(metrics_port, f"{histogram}_{part}") or 0.0 for part in ("sum", "count")]
    queue_task = asyncio.create_task(watch_queue())
    tasks = [asyncio.create_task(sse_stream(http_port, request, timeout_s)) for _ in range(n)]
    decisions = asyncio.create_task(watch_decisions(tasks))
    streams = list(await asyncio.gather(*tasks))
    stop.set()
    await queue_task
    decisions.cancel()
    last_written = max(s.sent_at for s in streams)
    decided = None if decided_at is None else max(0.0, decided_at - last_written)
    after = [await gauge(metrics_port, f"{histogram}_{part}") or 0.0 for part in ("sum", "count")]
    gateway_ttft = (after[0] - before[0]) / (after[1] - before[1]) if after[1] > before[1] else None
    return LoadRun(streams, decided, queue_max, gateway_ttft)


async def direct(worker: str, credentials: grpc.ChannelCredentials, n: int, max_tokens: int) -> list[float | str]:
    """The worker's TTFT for N requests sent at once straight to its gRPC Generate (or the error's status)."""
    async with grpc.aio.secure_channel(worker, credentials) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)

        async def one(i: int) -> float | str:
            # Read to the end, as the gateway does: the worker carries the same load in both runs.
            started = time.perf_counter()
            ttft = None
            try:
                async for reply in stub.Generate(worker_pb2.WorkerGenerateRequest(
                        request_id=f"direct-{n}-{i}", base_model=DEMO_BASE_MODEL, text=PROMPT,
                        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0))):
                    if ttft is None and reply.WhichOneof("payload") == "delta":
                        ttft = time.perf_counter() - started
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            assert ttft is not None, "the worker ended a request without a token"
            return ttft

        return list(await asyncio.gather(*(one(i) for i in range(n))))


async def normal_request_s(http_port: int, path: str = "/v1/models", headers: str = "") -> float:
    """GET `path` on a new connection (`headers`: extra header lines, each ending in CRLF): seconds
    until its whole answer, which must be a 200."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", http_port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{http_port}\r\n{headers}Connection: close\r\n\r\n".encode())
    answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    return time.perf_counter() - started


async def idle_delay(http_port: int, idle: int, repeats: int = 20, path: str = "/v1/models",
                     headers: str = "") -> tuple[float, float, int]:
    """Median seconds of a normal request (normal_request_s) without, then with `idle` idle connections
    open, and how many of those were still open at the end (a server may close them after its header timeout)."""
    without = statistics.median([await normal_request_s(http_port, path, headers) for _ in range(repeats)])
    connections = [await asyncio.open_connection("127.0.0.1", http_port) for _ in range(idle)]
    for _, writer in connections:
        writer.write(IDLE_PROBE)
    await asyncio.sleep(0.2)
    with_idle = statistics.median([await normal_request_s(http_port, path, headers) for _ in range(repeats)])
    still_open = sum(not reader.at_eof() for reader, _ in connections)
    for _, writer in connections:
        writer.close()
    return without, with_idle, still_open


@contextmanager
def running_system(max_streams: int, max_in_flight: int, max_tokens: int, log: Path | None) -> Iterator[RunningSystem]:
    """`tessera demo-assets`, then `tessera up` in a temporary home, the worker sized to batch `max_streams`;
    `log`: where the roles' log (tessera up's output) goes (default: the temporary home)."""
    blocks_per_stream = -(-(32 + max_tokens) // 16)  # the prompt's ~10 tokens and the output, in 16-token blocks
    with tempfile.TemporaryDirectory(prefix="gateway-load-") as home:
        env = system_env(Path(home), len(DEMO_MODELS), {
            "GATEWAY__MAX_QUEUED_PER_MODEL": max_in_flight, "WORKER__MAX_NUM_SEQS": max_streams,
            "WORKER__MAX_BATCH_TOKENS": 8192, "WORKER__KV_CACHE_TOKENS": max_streams * blocks_per_stream * 16})
        run_cli(["demo-assets"], env, timeout_s=900)
        with tessera_up(env, DEMO_MODELS, log or Path(home) / "launcher.log", timeout_s=300) as system:
            yield system


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = suite_parser(__doc__)
    parser.add_argument("--streams", type=int, nargs="+", default=[100, 500, 2000])
    parser.add_argument("--idle", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-in-flight", type=int, default=2048, help="the gateway's max_queued_per_model")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--log", type=Path, help="write the roles' log (tessera up's output) here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import uvloop  # the client's loop, as the roles'

    rows = []
    with exits_on_sigterm(), \
            running_system(max(args.streams), args.max_in_flight, args.max_tokens, args.log) as system:
        credentials = load_role_credentials(system.config, "gateway").channel()
        print(f"{os.cpu_count()}-core CPU, demo model, {args.max_tokens} tokens a stream, "
              f"admission bound {args.max_in_flight}")
        print(f"{'N':>6} {'held':>6} {'done':>6} {'429':>6} {'failed':>6} {'TTFT p50':>9} {'p99':>8} "
              f"{'worker p50':>10} {'p99':>8} {'added p50':>9} {'p99':>8} {'front':>7} {'decided':>8} {'accept q':>8}")
        for n in args.streams:
            answers = uvloop.run(direct(system.worker_grpc, credentials, n, args.max_tokens))
            worker = [a for a in answers if isinstance(a, float)]
            if len(worker) < n:
                print(f"       direct to the worker: {n - len(worker)} of {n} failed: "
                      f"{sorted({a for a in answers if isinstance(a, str)})}")
            run = uvloop.run(load(system.http_port, system.port("GATEWAY__METRICS_PORT"), n, args.max_tokens,
                                  args.timeout_s))
            ttfts = run.ttfts() or [float("nan")]
            row = {"streams": n, "held": run.held, "completed": run.completed, "refused_429": run.refused,
                   "failed": len(run.failed), "ttft_p50_ms": 1e3 * percentile(ttfts, 50),
                   "ttft_p99_ms": 1e3 * percentile(ttfts, 99), "worker_ttft_p50_ms": 1e3 * percentile(worker, 50),
                   "worker_ttft_p99_ms": 1e3 * percentile(worker, 99),
                   "all_decided_s": run.all_decided_s, "max_accept_queue": run.max_accept_queue,
                   "failures": sorted({s.error or str(s.status) for s in run.failed})[:5]}
            row["added_p50_ms"] = row["ttft_p50_ms"] - row["worker_ttft_p50_ms"]
            row["added_p99_ms"] = row["ttft_p99_ms"] - row["worker_ttft_p99_ms"]
            row["front_mean_ms"] = (None if run.gateway_ttft_mean_s is None or not run.ttfts() else
                                    1e3 * (statistics.fmean(run.ttfts()) - run.gateway_ttft_mean_s))
            rows.append(row)
            decided = "-" if run.all_decided_s is None else f"{run.all_decided_s:.2f} s"
            front = "-" if row["front_mean_ms"] is None else f"{row['front_mean_ms']:.0f}ms"
            print(f"{n:>6} {run.held:>6} {run.completed:>6} {run.refused:>6} {len(run.failed):>6} "
                  f"{row['ttft_p50_ms']:>7.0f}ms {row['ttft_p99_ms']:>6.0f}ms {row['worker_ttft_p50_ms']:>8.0f}ms "
                  f"{row['worker_ttft_p99_ms']:>6.0f}ms {row['added_p50_ms']:>7.0f}ms {row['added_p99_ms']:>6.0f}ms "
                  f"{front:>7} {decided:>8} {run.max_accept_queue:>8}", flush=True)
            if run.failed:
                print(f"       failures: {row['failures']}")
        without, with_idle, still_open = uvloop.run(idle_delay(system.http_port, args.idle))
        print(f"normal request (GET /v1/models, new connection, median of 20): {1e3 * without:.1f} ms alone, "
              f"{1e3 * with_idle:.1f} ms beside {args.idle} idle connections ({still_open} still open): "
              f"+{1e3 * (with_idle - without):.1f} ms")
    report = {"rows": rows, "idle": {"connections": args.idle, "alone_ms": 1e3 * without,
                                     "beside_idle_ms": 1e3 * with_idle, "still_open": still_open}}
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
