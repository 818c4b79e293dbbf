"""LoRA on the vision tower: what it adds to one encoder pass, on LLaVA-1.5-7B's CLIP ViT-L/14-336 and projector
(random bf16 weights).

One pass over a batch of 640x480 JPEG-shaped images (336 x 336 pixel values: 577 tokens each through 24 layers),
timed with CUDA events (median of `repeats` after warm-up): without tower LoRA, with every image on one tower
adapter, and with the images spread over several distinct adapters (PEFT's most common adapter: rank 16 on
q_proj and v_proj of every CLIP layer, as bare target names give). The figure: each time over the time
without tower LoRA (VaLoRA's claim for its ATMM kernel: mixed adapters batch at little cost).

    PYTHONPATH=.:protos python3 benchmarks/tower_bench.py [--json OUT.json]
    PYTHONPATH=.:protos python3 benchmarks/tower_bench.py --tiny   # a tiny LLaVA on CPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone

import torch
from transformers import LlavaConfig

from benchmarks.harness.cli import parse_gpu_or_tiny_args
from benchmarks.harness.llava import llava_7b_config, random_llava, tiny_llava_config
from benchmarks.harness.report import Report, write_json
from gpu_worker.device_kind import device_name
from gpu_worker.lora.loader import TowerWeights
from gpu_worker.models.llava import LlavaImageEncoder
from gpu_worker.vision.tower_lora import adapted, wrap
from services.common.adapter_layout import LLAVA_LAYOUT
from services.common.lora_config import LoraHyperparameters
from services.common.tower_lora import parse_tower_lora, tower_modules

ARCHITECTURE = "LlavaForConditionalGeneration"
TARGETS = ("q_proj", "v_proj")


@dataclass(frozen=True)
class Setup:
    config: LlavaConfig
    device: str
    dtype: torch.dtype
    rank: int
    images: int
    adapter_counts: tuple[int, ...]  # distinct tower adapters over the batch's images
    repeats: int


FULL = Setup(llava_7b_config(), "cuda", torch.bfloat16, 16, 8, (1, 8), 20)
TINY = Setup(tiny_llava_config(), "cpu", torch.float32, 4, 4, (1, 4), 3)


def tower_adapter(config: LlavaConfig, rank: int, seed: int, device: str, dtype: torch.dtype) -> TowerWeights:
    """Random rank-`rank` LoRA on TARGETS of every CLIP layer, shaped and parsed as the registry parses it."""
    modules = tower_modules(ARCHITECTURE, config.to_dict())
    shapes = {}
    for name, module in modules.items():
        if name.rsplit(".", 1)[1] in TARGETS:
            shapes[f"base_model.model.{name}.lora_A.weight"] = (rank, module.in_features)
            shapes[f"base_model.model.{name}.lora_B.weight"] = (module.out_features, rank)
    spec = parse_tower_lora(LLAVA_LAYOUT, shapes, modules, LoraHyperparameters(rank, 2.0 * rank), "bench")
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {name: (torch.randn(shape, generator=generator, device=device) * 0.01).to(dtype)
               for name, shape in spec.tensors}
    return TowerWeights(spec, tensors)


def time_pass(encoder: LlavaImageEncoder, pixels: torch.Tensor, towers: list[TowerWeights | None],
              repeats: int) -> float:
    """The median seconds of one encoder pass over `pixels` with each image's tower LoRA."""
    rows = {"image": [1] * len(towers)}
    times = []
    for _ in range(repeats + 2):  # two warm-up passes
        if pixels.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        started = time.perf_counter()
        with torch.inference_mode(), adapted(encoder.lora, rows, towers):
            encoder(pixels)
        if pixels.is_cuda:
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_gpu_or_tiny_args(__doc__, argv, "a tiny LLaVA")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    setup = TINY if args.tiny else FULL
    report = Report(device=device_name(torch.device(setup.device)))
    encoder = random_llava(setup.config, torch.device(setup.device), setup.dtype).image_encoder
    encoder.lora = wrap(encoder, dict.fromkeys(tower_modules(ARCHITECTURE, setup.config.to_dict()), "image"))
    size = setup.config.vision_config.image_size
    pixels = torch.randn(setup.images, 3, size, size, device=setup.device, dtype=setup.dtype)
    base_s = time_pass(encoder, pixels, [None] * setup.images, setup.repeats)
    report.add(adapters=0, images=setup.images, pass_ms=base_s * 1e3, ratio=1.0)
    for count in setup.adapter_counts:
        towers = [tower_adapter(setup.config, setup.rank, seed, setup.device, setup.dtype) for seed in range(count)]
        per_image = [towers[i * count // setup.images] for i in range(setup.images)]  # same adapters adjacent
        seconds = time_pass(encoder, pixels, per_image, setup.repeats)
        report.add(adapters=count, images=setup.images, pass_ms=seconds * 1e3, ratio=seconds / base_s)
    result = {"device": report.device, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "model": "tiny LLaVA" if args.tiny else "LLaVA-1.5-7B's CLIP ViT-L/14-336 and projector, random weights",
              "rank": setup.rank, "targets": TARGETS, "rows": report.rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
