"""The served system against its own engine: tokens/s through the REST gateway over tokens/s of the same
requests submitted in-process to an Engine, on one device.

1. Builds, under a temporary TESSERA_HOME, a checkpoint: on CUDA engine_bench's Llama-2-7B config with
   random bf16 weights (drawn on the GPU from a seeded generator, written as 2 GiB safetensors shards
   with an index), with --tiny the demo Llama's shape in float32 on the CPU; the tokenizer is the
   locally trained demo tokenizer without EOS (its vocabulary replaces Llama-2's, so that every sampled
   id decodes, and every request runs to exactly max_tokens). Then --adapters random rank-64 q,k,v,o
   LoRA adapters as PEFT directories (adapter_config.json written by peft's LoraConfig,
   adapter_model.safetensors). The model and the adapters are registered in the registry's store.
2. Starts the system as separate processes (`python -m services.cli certs`, then `... serve registry`,
   `serve worker`, `serve gateway`), mutual TLS between the roles on (the default), each one healthy
   before the next (probed as `tessera health --role` does), the worker's limits raised so that the
   largest batch runs at once (max_num_seqs, kv_cache_tokens), adapter slots for every adapter.
3. For each N in --streams: N streaming completions (`stream: true`, temperature 0, the usage chunk
   asked for) sent at once to the gateway's /v1/completions from raw asyncio sockets, round-robin over
   the adapters, prompts of ~128 tokens (distinct in their first KV block, so no prefix is reused),
   max_tokens each. Generated tokens (the usage's completion_tokens) over the wall time from the first
   request written to the last stream's end; TTFT (request written -> first text event) p50/p99.
   Best of --repeats runs (each with new prompts), after a warm-up batch.
4. Stops the system (the GPU's memory free again), builds an Engine as the worker does
   (gpu_worker.builder.build_engine over the same checkpoint, the same worker config, the adapters read
   from the same store) and runs the same requests in-process (submitted from an asyncio loop as the
   worker's servicer does, every stream drained); prints served / in-process tokens/s per N.

On a GPU machine (the 7B; estimated 4-6 minutes on an H100, 13 GB of disk under --home-parent):
    PYTHONPATH=.:protos python3 -m benchmarks.served_bench --json OUT.json --log-dir LOGS
On a CPU (the demo Llama, small counts, seconds):
    PYTHONPATH=.:protos python3 -m benchmarks.served_bench --tiny
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import torch
from transformers import LlamaConfig, PreTrainedTokenizerBase

from benchmarks.harness.serving import bench_tokenizer
from benchmarks.harness.shapes import LLAMA2_7B, RANK, TARGETS
from benchmarks.http_client import chunks, exchange, post_json, read_head
from gpu_worker.builder import build_engine
from gpu_worker.engine import Engine
from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.sequence import SamplingParams
from registry.store import RegistryStore
from services.common.adapter_layout import CONFIG_FILE, TEXT_LAYOUT, WEIGHTS_FILE
from services.common.config import TesseraConfig, load_config
from services.common.grpc_server import check_health
from services.common.tls import TlsError, health_probe_credentials
from services.demo_assets import LlamaShape
from services.launcher.supervisor import stop_process_group

REPO_ROOT = Path(__file__).resolve().parents[1]
BASE_MODEL = "bench-llama"
SHARD_BYTES = 2 * 2**30
PROMPT_WORDS = "the engine schedules every request on its adapter and streams each token as it comes".split()
ROLES = ("registry", "worker", "gateway")
PORTS = ("REGISTRY__GRPC_PORT", "REGISTRY__ADMIN_PORT", "REGISTRY__METRICS_PORT", "GATEWAY__HTTP_PORT",
         "GATEWAY__GRPC_PORT", "GATEWAY__METRICS_PORT", "WORKER__GRPC_PORT", "WORKER__METRICS_PORT")
_demo = LlamaShape()
TINY = dict(hidden_size=_demo.hidden_size, intermediate_size=_demo.intermediate_size,
            num_hidden_layers=_demo.num_layers, num_attention_heads=_demo.num_heads,
            num_key_value_heads=_demo.num_kv_heads, max_position_embeddings=_demo.max_position_embeddings,
            rms_norm_eps=1e-5)


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- the checkpoint and the adapters ------------------------------------------------------------

def model_config(shape: dict[str, Any], tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype) -> LlamaConfig:
    return LlamaConfig(**{**shape, "vocab_size": len(tokenizer)}, architectures=["LlamaForCausalLM"],
                       tie_word_embeddings=False,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
                       dtype=str(dtype).removeprefix("torch."))


def tensor_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face LlamaForCausalLM checkpoint of `config` (built on the meta device)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def build_checkpoint(directory: Path, config: LlamaConfig, tokenizer: PreTrainedTokenizerBase, device: torch.device,
                     dtype: torch.dtype, seed: int = 0, std: float = 0.02) -> None:
    """config.json, the tokenizer, and N(0, std) weights (norms 1) drawn on `device`, in safetensors shards."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    generator = torch.Generator(device=device).manual_seed(seed)
    shapes = tensor_shapes(config)
    total = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize
    say(f"writing {total / 2**30:.1f} GiB of random {dtype} weights ({len(shapes)} tensors) to {directory}")
    started = time.perf_counter()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in shapes.items():
        tensor = torch.empty(shape, device=device, dtype=dtype)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, std, generator=generator)
        if size and size + tensor.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    weight_map = {}
    written = 0
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: t.cpu() for name, t in shard.items()}, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        written += sum(t.nbytes for t in shard.values())
        shard.clear()
        elapsed = time.perf_counter() - started
        say(f"  shard {i}/{len(shards)}: {written / 2**30:5.1f} GiB in {elapsed:5.1f} s")
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    if device.type == "cuda":
        torch.cuda.empty_cache()


def build_adapter(directory: Path, base_dir: Path, config: LlamaConfig, device: torch.device, dtype: torch.dtype,
                  seed: int) -> None:
    """A real PEFT LoRA directory: rank RANK on q,k,v,o, random A and B."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(TARGETS), lora_dropout=0.0, bias="none",
               task_type="CAUSAL_LM", base_model_name_or_path=str(base_dir)).save_pretrained(directory)
    generator = torch.Generator(device=device).manual_seed(1000 + seed)
    hidden = config.hidden_size
    kv = config.num_key_value_heads * hidden // config.num_attention_heads
    outs = {"q_proj": hidden, "k_proj": kv, "v_proj": kv, "o_proj": hidden}
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target in TARGETS:
            path = f"self_attn.{target}"
            a = torch.empty(RANK, hidden, device=device, dtype=dtype).normal_(0, hidden ** -0.5, generator=generator)
            b = torch.empty(outs[target], RANK, device=device, dtype=dtype).normal_(0, 0.01, generator=generator)
            tensors[TEXT_LAYOUT.tensor_name(layer, path, "A")] = a.cpu()
            tensors[TEXT_LAYOUT.tensor_name(layer, path, "B")] = b.cpu()
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    assert (directory / CONFIG_FILE).is_file()


def register(config: TesseraConfig, base_dir: Path, adapter_dirs: dict[str, Path]) -> list[AdapterRef]:
    """The base model and the adapters in the registry's store (as `tessera demo-assets` does);
    the adapters as the registry hands them to a worker."""
    store = RegistryStore.from_config(config)
    try:
        store.register_base_model(BASE_MODEL, str(base_dir))
        records = [store.register_adapter(name, BASE_MODEL, str(path)) for name, path in adapter_dirs.items()]
    finally:
        store.close()
    return [AdapterRef(r.name, r.base_model, r.rank, r.sha256, r.storage_path) for r in records]


# --- the requests ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Request:
    request_id: str
    prompt: str
    model: str           # the base model or an adapter's name
    max_tokens: int


def prompt_text(k: int, prompt_tokens: int) -> str:
    """A prompt of about `prompt_tokens` tokens whose first KV block holds its number `k` (no prefix
    cache hits between two prompts)."""
    return f"request {k}: " + " ".join(PROMPT_WORDS[(k + j) % len(PROMPT_WORDS)] for j in range(prompt_tokens // 2))


def make_batch(first: int, n: int, models: list[str], prompt_tokens: int, max_tokens: int) -> list[Request]:
    return [Request(f"r{first + i}", prompt_text(first + i, prompt_tokens), models[(first + i) % len(models)],
                    max_tokens) for i in range(n)]


@dataclasses.dataclass
class Result:
    ttft_s: float | None = None
    tokens: int = 0
    done: bool = False
    error: str = ""


@dataclasses.dataclass
class Batch:
    streams: int
    wall_s: float
    results: list[Result]

    @property
    def completed(self) -> int:
        return sum(r.done for r in self.results)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def ttft_ms(self, q: float) -> float:
        values = sorted(r.ttft_s for r in self.results if r.ttft_s is not None) or [math.nan]
        return 1e3 * values[min(len(values) - 1, round(q * (len(values) - 1)))]

    def summary(self) -> dict[str, Any]:
        return {"streams": self.streams, "completed": self.completed, "tokens": self.tokens, "wall_s": self.wall_s,
                "tokens_per_s": self.tokens_per_s, "ttft_p50_ms": self.ttft_ms(0.5), "ttft_p99_ms": self.ttft_ms(0.99),
                "errors": sorted({r.error for r in self.results if r.error})[:5]}


# --- through the gateway --------------------------------------------------------------------------

async def rest_stream(port: int, request: Request, timeout_s: float) -> Result:
    """One streaming completion on a new connection: chunked SSE read to `data: [DONE]`."""
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


def rest_batch(port: int, requests: list[Request], timeout_s: float) -> Batch:
    async def run() -> tuple[float, list[Result]]:
        started = time.perf_counter()
        results = await asyncio.gather(*(rest_stream(port, r, timeout_s) for r in requests))
        return time.perf_counter() - started, list(results)

    wall, results = asyncio.run(run())
    return Batch(len(requests), wall, results)


# --- in-process -----------------------------------------------------------------------------------

def engine_batch(engine: Engine, requests: list[Request], adapters: dict[str, AdapterRef], timeout_s: float) -> Batch:
    """The same requests submitted to `engine` from an asyncio loop, as the worker's servicer does."""
    async def one(request: Request) -> Result:
        out = Result()
        started = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens)
        try:
            handle = await engine.submit_async(GenerationRequest(request.request_id, request.prompt, params,
                                                                 adapters.get(request.model)))
            async for output in handle:
                if out.ttft_s is None and output.text:
                    out.ttft_s = time.perf_counter() - started
                if output.finish_reason is not None:
                    out.tokens, out.done = output.completion_tokens, True
        except Exception as exc:  # recorded, as a failed stream is through the gateway
            out.error = f"{type(exc).__name__}: {exc}"
        return out

    async def run() -> tuple[float, list[Result]]:
        started = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*map(one, requests)), timeout_s)
        return time.perf_counter() - started, list(results)

    wall, results = asyncio.run(run())
    return Batch(len(requests), wall, results)


# --- the served system ------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def system_env(home: Path, device: str, max_streams: int, kv_cache_tokens: int, adapters: int) -> dict[str, str]:
    """The roles' environment: free ports, the worker sized for `max_streams` at once, this repository
    on PYTHONPATH (the children run `python -m services.cli` from it)."""
    ports = {name: free_port() for name in PORTS}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    path = [str(REPO_ROOT), str(REPO_ROOT / "protos"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update({f"TESSERA_{k}": str(v) for k, v in ports.items()})
    env.update({
        "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1", "TESSERA_HOME": str(home),
        "TESSERA_GATEWAY__REGISTRY_ADDRESS": f"127.0.0.1:{ports['REGISTRY__GRPC_PORT']}",
        "TESSERA_WORKER__REGISTRY_ADDRESS": f"127.0.0.1:{ports['REGISTRY__GRPC_PORT']}",
        "TESSERA_GATEWAY__METADATA_REFRESH_S": "0.5",
        "TESSERA_GATEWAY__MAX_QUEUED_PER_MODEL": str(4 * max_streams),
        "TESSERA_WORKER__DEVICE": device,
        "TESSERA_WORKER__BASE_MODEL": BASE_MODEL,
        "TESSERA_WORKER__MAX_NUM_SEQS": str(max_streams),
        "TESSERA_WORKER__MAX_BATCH_TOKENS": "8192",
        "TESSERA_WORKER__KV_CACHE_TOKENS": str(kv_cache_tokens),
        "TESSERA_WORKER__ADAPTER_SLOTS": str(max(8, adapters)),
        "TESSERA_WORKER__MAX_LORA_RANK": str(RANK),
        "TESSERA_WORKER__LORA_TARGETS": "[" + ", ".join(TARGETS) + "]",
    })
    return env


@dataclasses.dataclass
class System:
    env: dict[str, str]
    config: TesseraConfig
    processes: dict[str, subprocess.Popen] = dataclasses.field(default_factory=dict)

    @property
    def http_port(self) -> int:
        return self.config.gateway.http_port

    def address(self, role: str) -> str:
        section = getattr(self.config, role)
        return f"127.0.0.1:{section.grpc_port}"


def _wait_healthy(system: System, role: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    process = system.processes[role]
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{role} exited with code {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            credentials = health_probe_credentials(system.config, role)
        except TlsError:
            credentials = None
        if credentials is not None or role == "gateway":
            if check_health(system.address(role), timeout_s=1.0, credentials=credentials):
                return
        time.sleep(0.3)
    raise TimeoutError(f"{role} not healthy within {timeout_s:.0f} s:\n{log_path.read_text()[-4000:]}")


@contextmanager
def running_system(env: dict[str, str], log_dir: Path, ready_timeout_s: float) -> Iterator[System]:
    """Certificates, then registry, worker and gateway as separate processes, each healthy before the
    next; the gateway serving the base model. Every process is stopped (and waited for) on exit."""
    system = System(env, load_config(environ=env))
    cli = [sys.executable, "-m", "services.cli"]
    certs = subprocess.run([*cli, "certs"], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert certs.returncode == 0, certs.stdout + certs.stderr
    logs: list[TextIO] = []
    try:
        for role in ROLES:
            log_path = log_dir / f"{role}.log"
            logs.append(open(log_path, "w"))
            system.processes[role] = subprocess.Popen([*cli, "serve", role], env=env, cwd=REPO_ROOT, stdout=logs[-1],
                                                      stderr=subprocess.STDOUT, start_new_session=True)
            started = time.monotonic()
            _wait_healthy(system, role, log_path, ready_timeout_s)
            say(f"{role} healthy at {system.address(role)} after {time.monotonic() - started:.1f} s")
        deadline = time.monotonic() + 120
        probe = Request("ready", "ping", BASE_MODEL, 1)
        while not asyncio.run(rest_stream(system.http_port, probe, 30)).done:
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway cannot route to the worker")
            time.sleep(0.3)
        yield system
    finally:
        for role in reversed(list(system.processes)):
            stop_process_group(system.processes[role])
        for log in logs:
            log.close()


# --- the run --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
    streams: list[int]
    prompt_tokens: int
    max_tokens: int
    repeats: int
    models: list[str]
    timeout_s: float

    def batches(self) -> Iterator[tuple[str, int, list[Request]]]:
        """(label, N, requests) in order: a warm-up at the largest N, then --repeats runs of each N."""
        first = 0
        warm = max(self.streams)
        yield "warm-up", warm, make_batch(first, warm, self.models, self.prompt_tokens, min(8, self.max_tokens))
        first += warm
        for n in self.streams:
            for _ in range(self.repeats):
                yield "run", n, make_batch(first, n, self.models, self.prompt_tokens, self.max_tokens)
                first += n


def measure(plan: Plan, run_batch: Callable[[list[Request]], Batch], how: str) -> dict[int, list[Batch]]:
    runs: dict[int, list[Batch]] = {n: [] for n in plan.streams}
    for label, n, requests in plan.batches():
        batch = run_batch(requests)
        s = batch.summary()
        say(f"{how:10s} {label:7s} N={n:4d}: {s['completed']}/{n} completed, {s['tokens']} tokens in "
            f"{s['wall_s']:.2f} s = {s['tokens_per_s']:8.1f} tok/s; TTFT p50 {s['ttft_p50_ms']:.0f} ms "
            f"p99 {s['ttft_p99_ms']:.0f} ms{'; errors ' + str(s['errors']) if s['errors'] else ''}")
        if label == "run":
            runs[n].append(batch)
    return runs


def best(batches: list[Batch]) -> dict[str, Any]:
    top = max(batches, key=lambda b: b.tokens_per_s if b.completed == b.streams else -1.0)
    return {**top.summary(), "all_tokens_per_s": [b.tokens_per_s for b in batches],
            "all_completed": all(b.completed == b.streams for b in batches)}


def kv_tokens_needed(tokenizer: PreTrainedTokenizerBase, plan: Plan, block: int = 16) -> int:
    """KV-cache tokens for the largest batch at once, in whole blocks, with a margin."""
    longest = max(len(tokenizer(r.prompt).input_ids) for _, _, batch in plan.batches() for r in batch)
    per_stream = -(-(longest + plan.max_tokens) // block) * block
    return max(plan.streams) * per_stream + 64 * block


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())
    return f"{os.cpu_count()}-core {name}"


def environment(device: torch.device) -> dict[str, Any]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
            "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.served_bench", *sys.argv[1:]])}


def run(args: argparse.Namespace, home: Path) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if args.tiny else LLAMA2_7B
    info = environment(device)
    say(f"device {info['device']}; torch {info['torch']}; triton {info['triton']}; {info['date']}")
    tokenizer = bench_tokenizer()  # no EOS: every request runs to max_tokens
    config = model_config(shape, tokenizer, dtype)
    log_dir = args.log_dir or home / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    base_dir = home / "models" / BASE_MODEL
    started = time.perf_counter()
    build_checkpoint(base_dir, config, tokenizer, device, dtype)
    adapter_dirs = {f"bench-lora-{i}": home / "models" / "adapters" / f"bench-lora-{i}" for i in range(args.adapters)}
    for i, path in enumerate(adapter_dirs.values()):
        build_adapter(path, base_dir, config, device, dtype, seed=i)
    say(f"checkpoint and {args.adapters} adapters built in {time.perf_counter() - started:.1f} s")
    plan = Plan(sorted(args.streams), args.prompt_tokens, args.max_tokens, args.repeats,
                list(adapter_dirs) or [BASE_MODEL], args.timeout_s)
    env = system_env(home, str(device), max(plan.streams), kv_tokens_needed(tokenizer, plan), args.adapters)
    system_config = load_config(environ=env)
    refs = {ref.name: ref for ref in register(system_config, base_dir, adapter_dirs)}
    say(f"registered {BASE_MODEL} and {len(refs)} adapters; mutual TLS {'on' if system_config.tls.enabled else 'OFF'}")

    with running_system(env, log_dir, args.ready_timeout_s) as system:
        served = measure(plan, lambda requests: rest_batch(system.http_port, requests, plan.timeout_s), "served")
    say("system stopped; building the in-process engine")
    started = time.perf_counter()
    engine = build_engine(base_dir, system_config.worker, system_config.worker_adapter_store_path)
    say(f"engine built in {time.perf_counter() - started:.1f} s")
    engine.start()
    try:
        local = measure(plan, lambda requests: engine_batch(engine, requests, refs, plan.timeout_s), "in-process")
    finally:
        engine.stop()

    rows = []
    for n in plan.streams:
        row = {"streams": n, "served": best(served[n]), "in_process": best(local[n])}
        row["ratio"] = row["served"]["tokens_per_s"] / row["in_process"]["tokens_per_s"]
        rows.append(row)
    say(f"served / in-process, {info['device']}, torch {info['torch']}, triton {info['triton']}, {info['date']}:")
    for row in rows:
        s, p = row["served"], row["in_process"]
        print(f"  N={row['streams']:4d}  served {s['tokens_per_s']:9.1f} tok/s ({s['completed']}/{row['streams']} "
              f"completed)  in-process {p['tokens_per_s']:9.1f} tok/s ({p['completed']}/{row['streams']} completed)  "
              f"ratio {row['ratio']:.3f}  TTFT p50/p99 served {s['ttft_p50_ms']:.0f}/{s['ttft_p99_ms']:.0f} ms, "
              f"in-process {p['ttft_p50_ms']:.0f}/{p['ttft_p99_ms']:.0f} ms", flush=True)
    return {**info, "model": "Llama-2-7B shape, random bf16" if not args.tiny else "demo Llama shape, random float32",
            "config": {**shape, "vocab_size": len(tokenizer)}, "adapters": args.adapters, "rank": RANK,
            "targets": TARGETS, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "mutual_tls": system_config.tls.enabled,
            "worker": dataclasses.asdict(system_config.worker), "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the demo Llama's shape on the CPU, small counts")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    parser.add_argument("--streams", type=int, nargs="+", default=None, help="default: 32 256 (--tiny: 4 8)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=None, help="default: 128 (--tiny: 8)")
    parser.add_argument("--adapters", type=int, default=4, help="rank-64 q,k,v,o adapters, requests round-robin")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each N, the best kept (default 2, --tiny 1)")
    parser.add_argument("--timeout-s", type=float, default=180.0, help="one batch of requests")
    parser.add_argument("--ready-timeout-s", type=float, default=420.0, help="one role's start")
    parser.add_argument("--home-parent", type=Path, default=None, help="where the temporary TESSERA_HOME goes")
    parser.add_argument("--keep-home", action="store_true", help="keep the temporary TESSERA_HOME (13.5 GB on CUDA)")
    parser.add_argument("--log-dir", type=Path, default=None, help="the roles' logs (default: under the home)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.streams = args.streams or ([4, 8] if args.tiny else [32, 256])
    args.max_tokens = args.max_tokens or (8 if args.tiny else 128)
    args.repeats = args.repeats or (1 if args.tiny else 2)
    # A `timeout` (SIGTERM) still stops the roles and removes the home: the finally blocks run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    home = Path(tempfile.mkdtemp(prefix="served-bench-", dir=args.home_parent))
    try:
        report = run(args, home)
    finally:
        if not args.keep_home:
            shutil.rmtree(home, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
