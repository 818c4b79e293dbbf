"""Engine steps without the engine's thread: an engine's parts (gpu_worker.builder.EngineParts) driven
one step at a time, for the least host work a step needs (engine_bench, engine_loop_bench's "bare step").

    seqs = new_sequences(parts, 8, 128, ["own-0", None], generator)   # prompts, their adapters loaded
    prefill(parts, seqs, budget=4096)
    seconds = decode_step_seconds(parts, seqs, steps=30)
    release(parts, seqs)
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.harness.serving import BASE_MODEL
from benchmarks.harness.shapes import RANK
from gpu_worker.builder import EngineParts
from gpu_worker.orchestrator import UNMERGED, InferenceMode, StepPlan
from gpu_worker.profile import random_adapter_ref
from gpu_worker.sampler import sample
from gpu_worker.scheduler import ScheduledSeq
from gpu_worker.sequence import SamplingParams, Sequence

WARM_UP_STEPS = 3  # decode steps before the timed ones


def new_sequences(parts: EngineParts, count: int, prompt_len: int, adapters: list[str | None],
                  generator: torch.Generator) -> list[Sequence]:
    """`count` random prompts, sequence i on adapters[i % len] (a rank-RANK random adapter, loaded; None: the base)."""
    seqs = []
    for i in range(count):
        ids = torch.randint(0, parts.model.config.vocab_size, (prompt_len,), generator=generator).tolist()
        seq = Sequence(f"bench-{i}", ids, SamplingParams(max_tokens=4096), None, None)
        name = adapters[i % len(adapters)]
        if name is not None:
            seq.adapter = random_adapter_ref(name, BASE_MODEL, RANK)
            seq.slot, seq.rank = parts.adapters.load_now(seq.adapter)
        seqs.append(seq)
    return seqs


def release(parts: EngineParts, seqs: list[Sequence]) -> None:
    for seq in seqs:
        parts.scheduler.blocks.free(seq)
        if seq.adapter is not None:
            parts.adapters.depart(seq.adapter)


def run_step(parts: EngineParts, seqs: list[Sequence], num_new: list[int]) -> None:
    """One engine step without the engine thread: grow blocks, run, sample, append."""
    items = []
    for seq, n in zip(seqs, num_new):
        parts.scheduler.blocks.grow(seq, n)
        items.append(ScheduledSeq(seq, n, seq.num_cached + n == seq.num_tokens))
    sampling, logits, _ = parts.runner.run(items, step_plan(parts, seqs))
    tokens, _ = sample(logits, sampling).result()
    for seq, token in zip(sampling, tokens):
        seq.output_token_ids.append(token)


def step_plan(parts: EngineParts, seqs: list[Sequence]) -> StepPlan:
    """Merged when merged mode is on and every sequence uses one adapter (what the worker's policy does
    for such a batch once the switch has paid off), else unmerged."""
    slots = {(seq.slot, seq.adapter.name if seq.adapter else None) for seq in seqs}
    if parts.orchestrator.merge_switch is None or len(slots) != 1:
        return UNMERGED
    slot, name = slots.pop()
    return StepPlan(InferenceMode.MERGED, name, slot) if name is not None else UNMERGED


def prefill(parts: EngineParts, seqs: list[Sequence], budget: int) -> None:
    """Prefill `seqs` in steps of at most `budget` tokens."""
    pending = list(seqs)
    while pending:
        batch, counts, room = [], [], budget
        for seq in pending:
            n = min(seq.num_pending, room)
            if n:
                batch.append(seq)
                counts.append(n)
                room -= n
        run_step(parts, batch, counts)
        pending = [s for s in pending if s.num_pending > 1 or not s.output_token_ids]


def decode_step_seconds(parts: EngineParts, seqs: list[Sequence], steps: int) -> float:
    """Median wall-clock decode step, in steady state (after merged mode, if on, has merged)."""
    for _ in range(WARM_UP_STEPS):
        run_step(parts, seqs, [1] * len(seqs))
    times = []
    for _ in range(steps):
        if parts.model.lm_head.weight.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        run_step(parts, seqs, [1] * len(seqs))  # sampling syncs: the tokens are on the host
        times.append(time.perf_counter() - started)
    return statistics.median(times)
