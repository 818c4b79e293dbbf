"""`python -m gpu_worker.profile`: measure this worker kind's steps and fit the gateway's perf model.

Runs the engine's own machinery (model runner, paged KV cache, LoRA slots, sampler) over a grid of
batch compositions — batch sizes × prompt or context lengths × adapter cases (no adapter, one
adapter of rank r shared by the batch, an adapter of rank r per request, a mix of ranks) — and
times each step, keeping the fastest of a few passes (other processes on the machine only ever add
time). `PerfModel.fit` then keeps, per phase, the form with the best adjusted R², and the JSON
names the device and the kind workers report (gpu_worker/device_kind.py). Adapters are random
weights of each rank; merged mode is off, so a one-adapter batch is priced unmerged (an upper
bound once a worker merges a hot adapter).

    python -m gpu_worker.profile --model ~/.tessera/models/tessera-demo-llama --quick
      -> policy/perf_models/cpu-tessera-demo-llama.json
    python -m gpu_worker.profile --model DIR_WITH_CONFIG_JSON --random-weights --base-model llama-2-7b --device cuda
      -> policy/perf_models/<gpu>-llama-2-7b.json
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from policy.batch_summary import BatchEntry
from policy.perf_model import PERF_MODELS_DIR, PerfModel, Phase, ProfileSample, perf_model_path
from gpu_worker.builder import EngineParts, assemble_parts
from gpu_worker.device_kind import device_name, perf_model_kind
from gpu_worker.lora.loader import AdapterRef, LoRAModule, LoRAWeights
from gpu_worker.models.families import load_served_model
from gpu_worker.models.llama import LlamaForCausalLM, resolve_dtype
from gpu_worker.models.random_weights import random_llama
from gpu_worker.orchestrator import UNMERGED
from gpu_worker.sampler import sample
from gpu_worker.scheduler import ScheduledSeq
from gpu_worker.sequence import SamplingParams, Sequence
from services.common.config import WorkerConfig, load_config


Adapter = tuple[str, int] | None  # (name, rank); None: the base model


@dataclass(frozen=True)
class Grid:
    prefill_batches: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    context_lens: tuple[int, ...]
    ranks: tuple[int, ...]  # adapter ranks besides "no adapter"
    repeats: int            # passes over the grid; each composition keeps its fastest

    @property
    def max_batch(self) -> int:
        return max(self.prefill_batches + self.decode_batches)

    @property
    def max_step_tokens(self) -> int:
        return max(max(self.prefill_batches) * max(self.prompt_lens), max(self.decode_batches) * max(self.context_lens))


FULL = Grid((1, 2, 4, 8), (16, 64, 256, 512), (1, 4, 8, 16, 32), (32, 256, 1024), (8, 16, 32, 64), 5)
QUICK = Grid((1, 2, 4), (16, 64, 256), (1, 4, 8), (32, 256), (8, 64), 3)
TINY = Grid((1, 2), (8, 32), (1, 4), (16, 64), (8,), 2)  # a smoke test of the whole command
GRIDS = {"full": FULL, "quick": QUICK, "tiny": TINY}


def adapter_cases(batch: int, ranks: tuple[int, ...]) -> Iterator[tuple[str, list[Adapter]]]:
    """(case name, one adapter per request) for every case of a batch of `batch` requests."""
    yield "base", [None] * batch
    for r in ranks:
        yield f"shared-r{r}", [(f"shared-r{r}", r)] * batch
        if batch > 1:
            yield f"own-r{r}", [(f"own-r{r}-{i}", r) for i in range(batch)]
    if batch > 1 and len(ranks) > 1:
        yield "mixed", [(f"own-r{ranks[i % len(ranks)]}-{i}", ranks[i % len(ranks)]) for i in range(batch)]


def projection_dims(config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """PEFT target -> (in_features, out_features) of a Llama projection."""
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def random_adapter_ref(name: str, base_model: str, rank: int) -> AdapterRef:
    """An adapter of `random_adapters`: its weights follow from its name and rank, so their hash stands
    for the content digest that the adapter tiers key versions by."""
    return AdapterRef(name, base_model, rank, hashlib.sha256(f"{name}/r{rank}".encode()).hexdigest(), "")


def random_adapters(config: PretrainedConfig, targets: list[str], device: torch.device,
                    dtype: torch.dtype) -> Callable[[AdapterRef], LoRAWeights]:
    """A loader making a random adapter of `ref.rank` on every target (seeded by its name)."""
    dims = projection_dims(config)

    def load(ref: AdapterRef) -> LoRAWeights:
        # Drawn on the device: a rank-64 adapter of a 7B is ~10^8 numbers, seconds on a CPU.
        gen = torch.Generator(device=device).manual_seed(zlib.crc32(ref.name.encode()))

        def weight(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=gen, device=device) * 0.01).to(dtype)

        modules = {(layer, t): LoRAModule(weight(ref.rank, dims[t][0]), weight(dims[t][1], ref.rank), 2.0)
                   for layer in range(config.num_hidden_layers) for t in targets}
        return LoRAWeights(ref.name, modules)
    return load


class Profiler:
    def __init__(self, parts: EngineParts, device: torch.device, seed: int = 0) -> None:
        self._parts = parts
        self._device = device
        self._gen = torch.Generator().manual_seed(seed)
        self._vocab = parts.model.config.vocab_size

    def prefill(self, adapters: list[Adapter], prompt_len: int) -> ProfileSample:
        """One step prefilling every prompt whole."""
        seqs = self._sequences(adapters, prompt_len)
        seconds = self._step(seqs, [prompt_len] * len(seqs))
        self._release(seqs)
        return ProfileSample("prefill", _entries(adapters, prompt_len), seconds)

    def decode(self, adapters: list[Adapter], context_len: int, steps: int = 3) -> ProfileSample:
        """The fastest of `steps` decode steps (the first one warms up) over prompts of `context_len`."""
        seqs = self._sequences(adapters, context_len)
        self._step(seqs, [context_len] * len(seqs))
        times = [self._step(seqs, [1] * len(seqs)) for _ in range(steps)]
        self._release(seqs)
        return ProfileSample("decode", _entries(adapters, context_len + steps // 2 + 1), min(times[1:]))

    def _sequences(self, adapters: list[Adapter], prompt_len: int) -> list[Sequence]:
        seqs = []
        for i, adapter in enumerate(adapters):
            ids = torch.randint(0, self._vocab, (prompt_len,), generator=self._gen).tolist()
            seq = Sequence(f"profile-{i}", ids, SamplingParams(max_tokens=1 << 20), None, None)
            if adapter is not None:
                seq.adapter = random_adapter_ref(adapter[0], "profile", adapter[1])
                seq.slot, seq.rank = self._parts.adapters.load_now(seq.adapter)  # a slot per request
            seqs.append(seq)
        return seqs

    def _step(self, seqs: list[Sequence], num_new: list[int]) -> float:
        """Seconds of one engine step (forward + sampling; sampling syncs the device)."""
        items = []
        for seq, n in zip(seqs, num_new):
            self._parts.scheduler.blocks.grow(seq, n)
            items.append(ScheduledSeq(seq, n, seq.num_cached + n == seq.num_tokens))
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        started = time.perf_counter()
        sampling, logits, _ = self._parts.runner.run(items, UNMERGED)  # merged mode is off here
        tokens, _ = sample(logits, sampling).result()
        seconds = time.perf_counter() - started
        for seq, token in zip(sampling, tokens):
            seq.output_token_ids.append(token)
        return seconds

    def _release(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._parts.scheduler.blocks.free(seq)
            if seq.adapter is not None:
                self._parts.adapters.depart(seq.adapter)


def _entries(adapters: list[Adapter], tokens: int) -> tuple[BatchEntry, ...]:
    return tuple(BatchEntry(a[0] if a else "", a[1] if a else 0, tokens) for a in adapters)


def grid_plan(grid: Grid) -> list[tuple[Phase, int, int, str, list[Adapter]]]:
    """(phase, batch, tokens, case, adapters) of every composition of one pass over `grid`."""
    plan: list[tuple[Phase, int, int, str, list[Adapter]]] = [
        ("prefill", b, n, case, adapters) for b in grid.prefill_batches for n in grid.prompt_lens
        for case, adapters in adapter_cases(b, grid.ranks)]
    return plan + [("decode", b, n, case, adapters) for b in grid.decode_batches for n in grid.context_lens
                   for case, adapters in adapter_cases(b, grid.ranks)]


def run_grid(profiler: Profiler, grid: Grid, progress: Callable[[str], None]) -> list[ProfileSample]:
    """Every composition once per pass, `grid.repeats` passes; each keeps its fastest pass. Passes,
    not back-to-back repeats: a burst of load from another process then spoils one pass of a
    composition, not all of its measurements."""
    plan = grid_plan(grid)
    best: list[ProfileSample | None] = [None] * len(plan)
    for done in range(grid.repeats):
        for i, (phase, batch, tokens, case, adapters) in enumerate(plan):
            sample = (profiler.prefill if phase == "prefill" else profiler.decode)(adapters, tokens)
            if best[i] is None or sample.seconds < best[i].seconds:
                best[i] = sample
        progress(f"pass {done + 1}/{grid.repeats}: {len(plan)} compositions")
    for (phase, batch, tokens, case, _), sample in zip(plan, best):
        progress(f"  {phase} batch={batch} tokens={tokens} {case}: {sample.seconds * 1e3:.2f} ms")
    return best


def profile(model_dir: Path, device: torch.device, base_model: str, grid: Grid,
            progress: Callable[[str], None], random_weights: bool = False) -> PerfModel:
    dtype = resolve_dtype("auto", device)
    if random_weights:
        model = random_llama(AutoConfig.from_pretrained(model_dir), device=device, dtype=dtype)
    else:
        model = load_served_model(model_dir, device=device, dtype=dtype).language_model
    weights = ", random weights" if random_weights else ""
    return profile_model(model, base_model, grid, progress, "python -m gpu_worker.profile", weights)


def profile_model(model: LlamaForCausalLM, base_model: str, grid: Grid, progress: Callable[[str], None],
                  by: str, note: str = "", lora_targets: list[str] | None = None) -> PerfModel:
    """Profile a loaded (language) model on its device over `grid` (its own KV cache and adapter slots,
    freed after) and fit its kind's model; `by` and `note` say how, in the model's source."""
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    worker = WorkerConfig(base_model=base_model, device=str(device), max_num_seqs=grid.max_batch,
                          max_batch_tokens=grid.max_step_tokens, adapter_slots=2 * grid.max_batch,
                          max_lora_rank=max(grid.ranks), mode_policy="unmerged", cpu_lora_workers=0,
                          kv_cache_tokens=grid.max_batch * (max(grid.prompt_lens + grid.context_lens) + 4
                                                            + 2 + WorkerConfig().kv_block_size))
    if lora_targets is not None:
        worker.lora_targets = list(lora_targets)
    parts = assemble_parts(model, worker, Path("/nonexistent"),
                           load=random_adapters(model.config, worker.lora_targets, device, dtype))
    name = device_name(device)
    started = time.perf_counter()
    samples = run_grid(Profiler(parts, device), grid, progress)
    source = (f"{by} on {name}: {len(samples)} steps of {base_model}{note} (ranks "
              f"{', '.join(map(str, grid.ranks))}, merged mode off), {time.perf_counter() - started:.0f} s")
    del parts
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the profile's cache and slots go before the served engine sizes its own
    fitted = PerfModel.fit(perf_model_kind(name, base_model), name, samples)
    return PerfModel(fitted.kind, fitted.device, fitted.prefill, fitted.decode, source)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory (e.g. the demo model's)")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights of --model's config.json (timings depend on shapes only): profile a "
                        "7B-shaped model where no checkpoint is at hand")
    p.add_argument("--base-model", help="the name workers serve it under (default: the directory's name)")
    p.add_argument("--device", default="cpu", help='"cpu", "cuda", "cuda:1"')
    p.add_argument("--out", type=Path, help="JSON to write (default: <worker.perf_model_cache>/<kind>.json, which "
                                             "workers of that kind on this home take first)")
    p.add_argument("--grid", choices=GRIDS, default="full", help="full, quick (under a minute on a CPU) or tiny")
    p.add_argument("--quick", action="store_const", dest="grid", const="quick", help="--grid quick")
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available")
    model = profile(args.model, device, args.base_model or args.model.name, GRIDS[args.grid],
                    lambda line: print(line, file=sys.stderr, flush=True), args.random_weights)
    out = args.out or perf_model_path(model.kind, load_config().perf_model_cache_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out)
    print(f"{model.kind} on {model.device} -> {out}")
    if args.out is None:  # the committed models are the repository's: shipping this one is a commit of its own
        print(f"  workers of kind {model.kind} on this home take it at their next start; to ship it, commit it as "
              f"{perf_model_path(model.kind, PERF_MODELS_DIR)}")
    for phase in (model.prefill, model.decode):
        forms = ", ".join(f"{form} R²={r2:.4f}" for form, r2 in phase.r2_by_form.items())
        print(f"  {phase.phase}: chose {phase.form} (R²={phase.r2:.4f}, {phase.samples} samples); {forms}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
