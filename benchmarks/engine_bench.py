"""Engine benchmark on a 7B-shaped Llama (Llama-2-7B config, random bf16 weights), one GPU.

Measures in one run, on the device it names:
  1. the ceilings: device-to-device copy bandwidth (bytes read + written) and a bf16 matmul's rate;
  2. the decode step (host scheduling + forward + sampling, wall clock, CUDA graphs on) at batch
     1, 8, 32, 64 for (a) base only, (b) every request on one rank-64 q,k,v,o adapter (merged mode,
     and unmerged through the LoRA kernels), (c) every request on its own rank-64 q,k,v,o adapter;
     each against its weight-streaming floor: the
     bytes the step must read at least once (base weights less the embedding table, plus every
     adapter the step uses) over the copy bandwidth;
  3. prefill throughput of 2048-token prompts against the matmul rate;
  4. end-to-end generation throughput against the naive alternative: transformers + PEFT
     `generate` with `adapter_names`, on the same requests (32 distinct adapters, and one). Tessera's
     is measured twice: as served (requests through a running Engine with the worker's default
     scheduling, their text detokenized and streamed; the demo tokenizer padded to the vocabulary),
     and as a loop of bare steps (`run_step`, no engine thread: the figure of earlier sessions).

    PYTHONPATH=.:protos python3 -m benchmarks.engine_bench [--quick] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig

from benchmarks.harness.adapter_files import AdapterShape, adapter_bytes
from benchmarks.harness.bare_steps import WARM_UP_STEPS, decode_step_seconds, new_sequences, prefill, release, run_step
from benchmarks.harness.cli import suite_parser
from benchmarks.harness.prompts import exact_prompt, fillers
from benchmarks.harness.report import Report, write_json
from benchmarks.harness.serving import bench_request, bench_tokenizer, running_engine, serve
from benchmarks.harness.shapes import LLAMA2_7B, QKVO, RANK, TARGETS
from gpu_worker.builder import assemble_parts, async_scheduling_on
from gpu_worker.engine import StepRecord
from gpu_worker.models.random_weights import random_llama
from gpu_worker.profile import random_adapters
from kernels import tiling
from kernels.tuner.timing import copy_bandwidth
from services.common.config import WorkerConfig

DECODE_BATCHES = (1, 8, 32, 64)
DECODE_CONTEXT = 128       # prompt tokens cached before the timed decode steps
PREFILL_LEN = 2048
E2E_BATCH, E2E_PROMPT, E2E_NEW = 32, 128, 32
E2E_CASES = (("distinct", [f"own-{i}" for i in range(E2E_BATCH)]), ("one", ["shared"]))


# --- ceilings ---------------------------------------------------------------------------------

def cuda_time_s(fn: Callable[[], None], repeats: int) -> float:
    """Median seconds of `fn` timed with CUDA events, after a warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def matmul_flops() -> float:
    """FLOP/s of an 8192^3 bf16 matmul on random data."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    seconds = cuda_time_s(lambda: a @ b, repeats=10)
    return 2 * 8192**3 / seconds


# --- Tessera ----------------------------------------------------------------------------------

def kv_bytes_per_token(config: LlamaConfig) -> int:
    """Bytes of K and V one cached token holds over all layers, bf16: what decode attention reads."""
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2


def bench_tessera(report: Report, config: LlamaConfig, bandwidth: float, peak_flops: float, quick: bool,
                  context: int) -> dict:
    model = random_llama(config, device="cuda", dtype=torch.bfloat16)
    max_batch = max(DECODE_BATCHES)
    worker = WorkerConfig(device="cuda", dtype="bfloat16", max_num_seqs=max_batch, max_batch_tokens=4 * PREFILL_LEN,
                          adapter_slots=max_batch, max_lora_rank=RANK, lora_targets=TARGETS,
                          kv_cache_tokens=max(max_batch * 256, 4 * PREFILL_LEN + 64))
    started = time.perf_counter()
    load = random_adapters(config, TARGETS, torch.device("cuda"), torch.bfloat16)
    parts = assemble_parts(model, worker, Path("/nonexistent"), load=load)
    print(f"engine ready in {time.perf_counter() - started:.1f} s (CUDA graphs captured)", flush=True)
    base_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    one_adapter = adapter_bytes(config, AdapterShape(RANK, QKVO), 2)  # bf16, at its true size
    gen = torch.Generator().manual_seed(0)
    results: dict = {"decode": {}}

    print(f"decode step (context {context} + steps), wall clock per step:", flush=True)
    steps = 10 if quick else 30
    for batch in DECODE_BATCHES:
        # b_unmerged runs the one-adapter batch through the LoRA kernels (merged mode off);
        # b_one_adapter is the engine as configured: merged mode folds the adapter in.
        for case, adapters in (("a_base", [None]), ("b_unmerged", ["shared"]), ("b_one_adapter", ["shared"]),
                               ("c_own_adapters", [f"own-{i}" for i in range(batch)])):
            seqs = new_sequences(parts, batch, context, adapters, gen)
            merge_switch = parts.orchestrator.merge_switch
            if case == "b_unmerged":
                parts.orchestrator.merge_switch = None  # the previous case was base-only: nothing is merged now
            prefill(parts, seqs, worker.max_batch_tokens)
            seconds = decode_step_seconds(parts, seqs, steps)
            parts.orchestrator.merge_switch = merge_switch
            release(parts, seqs)
            used = len({a for a in adapters if a is not None})
            floor = (base_bytes + used * one_adapter) / bandwidth
            # The floor leaves out the KV cache attention reads; beside it, the floor with it.
            mean_context = context + WARM_UP_STEPS + steps // 2
            kv_floor = batch * mean_context * kv_bytes_per_token(config) / bandwidth
            results["decode"][(batch, case)] = seconds
            report.add(kind="decode", batch=batch, case=case, step_ms=seconds * 1e3, floor_ms=floor * 1e3,
                       over_floor=seconds / floor, over_floor_with_kv=seconds / (floor + kv_floor))
    for batch in DECODE_BATCHES:
        a, b = results["decode"][(batch, "a_base")], results["decode"][(batch, "b_one_adapter")]
        report.add(kind="ratio", batch=batch, b_over_a=b / a, b_unmerged_over_a=results["decode"][(batch, "b_unmerged")] / a,
                   c_over_a=results["decode"][(batch, "c_own_adapters")] / a)

    print(f"prefill, 4 prompts x {PREFILL_LEN} tokens in one step:", flush=True)
    tokens = 4 * PREFILL_LEN
    layer_params = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
    h, layers = config.hidden_size, config.num_hidden_layers
    flops = 2 * layer_params * tokens + 4 * PREFILL_LEN * (PREFILL_LEN + 1) / 2 * h * layers * 4  # + causal attention
    for case, adapters in (("base", [None]), ("own_adapters", ["own-0", "own-1", "own-2", "own-3"])):
        times = []
        for _ in range(2 if quick else 4):
            seqs = new_sequences(parts, 4, PREFILL_LEN, adapters, gen)
            torch.cuda.synchronize()
            started = time.perf_counter()
            run_step(parts, seqs, [PREFILL_LEN] * 4)
            times.append(time.perf_counter() - started)
            release(parts, seqs)
        seconds = statistics.median(times[1:])
        report.add(kind="prefill", case=case, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
                   tflops=flops / seconds / 1e12, of_matmul_peak=flops / seconds / peak_flops)

    print(f"end to end: {E2E_BATCH} requests x ({E2E_PROMPT} prompt + {E2E_NEW} new tokens):", flush=True)
    results["e2e"] = {}
    tokenizer = bench_tokenizer(config.vocab_size)
    padding = fillers(tokenizer)
    served_async = async_scheduling_on(WorkerConfig().async_scheduling, torch.device("cuda"))
    steps: list[StepRecord] = []
    with running_engine(parts, tokenizer, RANK, served_async, on_step=steps.append) as engine:
        for case, adapters in E2E_CASES:
            requests = [bench_request(f"e2e-{case}-{i}", exact_prompt(tokenizer, padding, gen, E2E_PROMPT), E2E_NEW,
                                      adapters[i % len(adapters)], RANK) for i in range(E2E_BATCH)]
            steps.clear()
            results["e2e"][case] = E2E_BATCH * E2E_NEW / serve(engine, requests)
            report.add(kind="e2e_tessera", adapters=case, tokens_per_s=results["e2e"][case], served=True,
                       async_scheduling=served_async, steps=len(steps),
                       steps_with_prefill=sum(1 for step in steps if step.num_prefills),
                       merged_steps=sum(1 for step in steps if step.merged_adapter))
    for case, adapters in E2E_CASES:
        seqs = new_sequences(parts, E2E_BATCH, E2E_PROMPT, adapters, gen)
        torch.cuda.synchronize()
        started = time.perf_counter()
        prefill(parts, seqs, worker.max_batch_tokens)
        for _ in range(E2E_NEW - 1):
            run_step(parts, seqs, [1] * len(seqs))
        seconds = time.perf_counter() - started
        release(parts, seqs)
        report.add(kind="e2e_tessera_steps", adapters=case, tokens_per_s=E2E_BATCH * E2E_NEW / seconds)
    del parts, model
    gc.collect()
    torch.cuda.empty_cache()
    return results


# --- the naive alternative: transformers + PEFT generate --------------------------------------

def bench_peft(report: Report, config: LlamaConfig, tessera: dict, quick: bool) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = HFLlama(config).eval()
        lora = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, init_lora_weights=False)
        model = get_peft_model(model, lora, adapter_name="own-0")
        for i in range(1, E2E_BATCH):
            model.add_adapter(f"own-{i}", lora)
    model.eval()  # PEFT takes adapter_names only in eval mode
    torch.set_default_dtype(default)
    ids = torch.randint(0, config.vocab_size, (E2E_BATCH, E2E_PROMPT), device="cuda")
    for case, names in (("distinct", [f"own-{i}" for i in range(E2E_BATCH)]), ("one", ["own-0"] * E2E_BATCH)):
        new = 8 if quick else E2E_NEW

        def generate() -> None:
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names,
                           max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            generate()  # warm-up
            torch.cuda.synchronize()
            started = time.perf_counter()
            generate()
            torch.cuda.synchronize()
        throughput = E2E_BATCH * new / (time.perf_counter() - started)
        report.add(kind="e2e_peft", adapters=case, tokens_per_s=throughput,
                   tessera_over_peft=tessera["e2e"][case] / throughput)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = suite_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--skip-peft", action="store_true", help="skip the transformers + PEFT baseline")
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--context", type=int, default=DECODE_CONTEXT,
                        help=f"prompt tokens cached before the timed decode steps (default {DECODE_CONTEXT})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    report = Report(device=torch.cuda.get_device_name())
    tables = tiling.table_for(torch.device("cuda"))["sources"]  # where the LoRA kernels' tiles come from
    print(f"device: {report.device}; torch {torch.__version__}; decode context {args.context}; "
          f"LoRA tile tables: {', '.join(tables) or 'none (heuristics)'}", flush=True)
    bandwidth, peak = copy_bandwidth(), matmul_flops()
    report.add(kind="ceiling", copy_tb_per_s=bandwidth / 1e12, bf16_matmul_tflops=peak / 1e12)
    config = LlamaConfig(**LLAMA2_7B)
    tessera = bench_tessera(report, config, bandwidth, peak, args.quick, args.context)
    if not args.skip_peft:
        bench_peft(report, config, tessera, args.quick)
    result = {"device": report.device, "lora_tables": tables, "rows": report.rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
