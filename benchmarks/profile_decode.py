"""Where a decode step's time goes, on the 7B-shaped model of engine_bench.py (one GPU).

For one batch size and adapter case it prints: the wall-clock step (host + device), the replay of
the step's CUDA graph alone (CUDA events), the sum of the kernels' own times from the profiler
(an eager forward, same kernels), and the kernels that take the most time.

    python3 benchmarks/profile_decode.py --batch 1 --case a_base
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import (DECODE_CONTEXT, LLAMA2_7B, RANK, TARGETS, cuda_time_s, decode_step_seconds,  # noqa: E402
                          new_sequences, prefill)
from transformers import LlamaConfig  # noqa: E402

from gpu_worker.builder import assemble_parts  # noqa: E402
from gpu_worker.models.random_weights import random_llama  # noqa: E402
from gpu_worker.profile import random_adapters  # noqa: E402
from gpu_worker.cuda_graphs import lora_mode  # noqa: E402
from gpu_worker.step_inputs import build_step_inputs  # noqa: E402
from gpu_worker.scheduler import ScheduledSeq  # noqa: E402
from services.config import WorkerConfig  # noqa: E402

CASES = {"a_base": lambda b: [None], "b_one_adapter": lambda b: ["shared"],
         "c_own_adapters": lambda b: [f"own-{i}" for i in range(b)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--case", choices=sorted(CASES), nargs="+", default=sorted(CASES))
    args = parser.parse_args()
    config = LlamaConfig(**LLAMA2_7B)
    model = random_llama(config, device="cuda", dtype=torch.bfloat16)
    worker = WorkerConfig(device="cuda", dtype="bfloat16", max_num_seqs=max(args.batch), max_batch_tokens=8192,
                          adapter_slots=max(args.batch), max_lora_rank=RANK, lora_targets=TARGETS,
                          kv_cache_tokens=max(args.batch) * 256 + 64)
    load = random_adapters(config, TARGETS, torch.device("cuda"), torch.bfloat16)
    parts = assemble_parts(model, worker, Path("/nonexistent"), load=load)
    graphs = parts.runner.graphs
    gen = torch.Generator().manual_seed(0)
    for batch in args.batch:
        for case in args.case:
            seqs = new_sequences(parts, batch, DECODE_CONTEXT, CASES[case](batch), gen)
            prefill(parts, seqs, worker.max_batch_tokens)
            wall = decode_step_seconds(parts, seqs, 20)
            for seq in seqs:
                parts.scheduler.blocks.grow(seq, 1)
            inputs = build_step_inputs([ScheduledSeq(s, 1, True) for s in seqs], parts.runner.kv_cache.block_size)
            replay = cuda_time_s(lambda: graphs.replay(inputs), repeats=20)
            key = (graphs._bucket(batch), lora_mode(inputs.seg_lens, inputs.seg_slots), DECODE_CONTEXT * 4)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    graphs._forward(*key)  # the same kernels as the replayed graph, launched eagerly
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
            kernel_s = sum(e.self_device_time_total for e in events) / 3 / 1e6
            launches = sum(e.count for e in events) / 3
            print(f"batch {batch} {case}: wall {wall * 1e3:.3f} ms, graph replay with input staging {replay * 1e3:.3f} ms, "
                  f"kernels {kernel_s * 1e3:.3f} ms in {launches:.0f} launches", flush=True)
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
                print(f"    {e.self_device_time_total / 3 / 1e3:8.3f} ms  x{e.count // 3:<5} {e.key[:90]}")
            for seq in seqs:
                parts.scheduler.blocks.free(seq)
                if seq.adapter is not None:
                    parts.adapters.release(seq.adapter.name)


if __name__ == "__main__":
    main()
