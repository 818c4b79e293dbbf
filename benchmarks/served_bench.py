"""The served system against its own engine: tokens/s through the REST gateway over tokens/s of the same
requests submitted in-process to an Engine, on one device.

1. Builds, under a temporary TESSERA_HOME, a checkpoint: on CUDA the Llama-2-7B config with
   random bf16 weights (drawn on the GPU from a seeded generator, written as 2 GiB safetensors shards
   with an index), with --tiny the demo Llama's shape in float32 on the CPU; the tokenizer is the
   locally trained demo tokenizer without EOS (its vocabulary replaces Llama-2's, so that every sampled
   id decodes, and every request runs to exactly max_tokens). Then --adapters random rank-64 q,k,v,o
   LoRA adapters as PEFT directories (adapter_config.json written by peft's LoraConfig,
   adapter_model.safetensors; benchmarks/harness/adapter_files.py). The model and the adapters are
   registered in the registry's store.
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
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, PreTrainedTokenizerBase

from benchmarks.harness.adapter_files import AdapterShape, AdapterStore
from benchmarks.harness.cli import command_line, exits_on_sigterm, suite_parser
from benchmarks.harness.completions import Request, Result, rest_stream
from benchmarks.harness.live_system import served_roles, system_env
from benchmarks.harness.prompts import word_prompt
from benchmarks.harness.report import percentile, progress, write_json
from benchmarks.harness.serving import bench_tokenizer
from benchmarks.harness.shapes import DEMO_LLAMA, LLAMA2_7B, QKVO, RANK, TARGETS
from gpu_worker.builder import build_engine
from gpu_worker.engine import Engine
from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.sequence import SamplingParams
from registry.store import RegistryStore
from services.common.config import TesseraConfig, load_config

BASE_MODEL = "bench-llama"
SHARD_BYTES = 2 * 2**30


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
    progress(f"writing {total / 2**30:.1f} GiB of random {dtype} weights ({len(shapes)} tensors) to {directory}")
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
        progress(f"  shard {i}/{len(shards)}: {written / 2**30:5.1f} GiB in {elapsed:5.1f} s")
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    if device.type == "cuda":
        torch.cuda.empty_cache()


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

def make_batch(first: int, n: int, models: list[str], prompt_tokens: int, max_tokens: int) -> list[Request]:
    return [Request(f"r{first + i}", word_prompt(first + i, prompt_tokens), models[(first + i) % len(models)],
                    max_tokens) for i in range(n)]


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
        values = [r.ttft_s for r in self.results if r.ttft_s is not None]
        return 1e3 * percentile(values, q) if values else math.nan

    def summary(self) -> dict[str, Any]:
        return {"streams": self.streams, "completed": self.completed, "tokens": self.tokens, "wall_s": self.wall_s,
                "tokens_per_s": self.tokens_per_s, "ttft_p50_ms": self.ttft_ms(50), "ttft_p99_ms": self.ttft_ms(99),
                "errors": sorted({r.error for r in self.results if r.error})[:5]}


# --- through the gateway --------------------------------------------------------------------------

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

def role_settings(device: str, max_streams: int, kv_cache_tokens: int, adapters: int) -> dict[str, object]:
    """The roles' settings beyond the launcher's: the worker sized for `max_streams` at once."""
    return {"GATEWAY__METADATA_REFRESH_S": 0.5, "GATEWAY__MAX_QUEUED_PER_MODEL": 4 * max_streams,
            "WORKER__DEVICE": device, "WORKER__BASE_MODEL": BASE_MODEL, "WORKER__MAX_NUM_SEQS": max_streams,
            "WORKER__MAX_BATCH_TOKENS": 8192, "WORKER__KV_CACHE_TOKENS": kv_cache_tokens,
            "WORKER__ADAPTER_SLOTS": max(8, adapters), "WORKER__MAX_LORA_RANK": RANK,
            "WORKER__LORA_TARGETS": "[" + ", ".join(TARGETS) + "]"}


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
        progress(f"{how:10s} {label:7s} N={n:4d}: {s['completed']}/{n} completed, {s['tokens']} tokens in "
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


def environment(device: torch.device, command: str) -> dict[str, Any]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
            "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command}


def run(args: argparse.Namespace, home: Path, command: str) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = DEMO_LLAMA if args.tiny else LLAMA2_7B
    info = environment(device, command)
    progress(f"device {info['device']}; torch {info['torch']}; triton {info['triton']}; {info['date']}")
    tokenizer = bench_tokenizer()  # no EOS: every request runs to max_tokens
    config = model_config(shape, tokenizer, dtype)
    log_dir = args.log_dir or home / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    base_dir = home / "models" / BASE_MODEL
    started = time.perf_counter()
    build_checkpoint(base_dir, config, tokenizer, device, dtype)
    store = AdapterStore(home / "models" / "adapters", config, BASE_MODEL, dtype, device)
    adapter_dirs = {f"bench-lora-{i}": Path(store.new(AdapterShape(RANK, QKVO)).ref.storage_path)
                    for i in range(args.adapters)}
    progress(f"checkpoint and {args.adapters} adapters built in {time.perf_counter() - started:.1f} s")
    plan = Plan(sorted(args.streams), args.prompt_tokens, args.max_tokens, args.repeats,
                list(adapter_dirs) or [BASE_MODEL], args.timeout_s)
    env = system_env(home, 1, role_settings(str(device), max(plan.streams), kv_tokens_needed(tokenizer, plan),
                                            args.adapters))
    system_config = load_config(environ=env)
    refs = {ref.name: ref for ref in register(system_config, base_dir, adapter_dirs)}
    progress(f"registered {BASE_MODEL} and {len(refs)} adapters; "
             f"mutual TLS {'on' if system_config.tls.enabled else 'OFF'}")

    with served_roles(env, log_dir, BASE_MODEL, args.ready_timeout_s) as system:
        served = measure(plan, lambda requests: rest_batch(system.http_port, requests, plan.timeout_s), "served")
    progress("system stopped; building the in-process engine")
    started = time.perf_counter()
    engine = build_engine(base_dir, system_config.worker, system_config.worker_adapter_store_path)
    progress(f"engine built in {time.perf_counter() - started:.1f} s")
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
    progress(f"served / in-process, {info['device']}, torch {info['torch']}, triton {info['triton']}, {info['date']}:")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = suite_parser(__doc__)
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
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with exits_on_sigterm():  # a `timeout` still stops the roles and removes the home
        home = Path(tempfile.mkdtemp(prefix="served-bench-", dir=args.home_parent))
        try:
            report = run(args, home, command_line("benchmarks.served_bench", argv))
        finally:
            if not args.keep_home:
                shutil.rmtree(home, ignore_errors=True)
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
