"""The task heads of the demo adapters (docs/task-heads.md), with random weights: what a head adds to an
adapter's two files. A classifier is PEFT's own SEQ_CLS head (services/demo_assets.py saves it through
PEFT); VaLoRA's MLP and detection heads are plain tensors written beside the LoRA ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from services.common.adapter_layout import CONFIG_FILE, WEIGHTS_FILE
from services.common.task_heads import PEFT_MODULE_PREFIX

# Random heads' weights: large enough that probabilities differ clearly between prompts.
HEAD_INIT_STD = 0.5


@dataclass(frozen=True)
class DemoHead:
    kind: str                  # "classifier" (PEFT SEQ_CLS), "mlp" or "detection" (VaLoRA's)
    labels: tuple[str, ...]
    num_queries: int = 1       # detection: the prompt's last tokens it reads
    inner: int = 64            # mlp and detection: the width inside the head


def head_config(head: DemoHead) -> dict[str, Any]:
    """What the head adds to adapter_config.json."""
    if head.kind == "classifier":
        return {"id2label": {str(i): label for i, label in enumerate(head.labels)}}
    declared: dict[str, Any] = {"kind": head.kind, "labels": list(head.labels)}
    if head.kind == "mlp":
        declared["activation"] = "relu"
    else:
        declared.update(num_queries=head.num_queries, box_format="cxcywh", score_threshold=0.3)
    return {"task_head": declared}


def valora_head_tensors(head: DemoHead, hidden: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The MLP or detection head's tensors, by their names in adapter_model.safetensors."""
    n, inner = len(head.labels), head.inner
    shapes = {"fc1": (inner, hidden), "fc2": (n, inner)} if head.kind == "mlp" else {
        "class_embed": (n + 1, hidden), "bbox_embed.layers.0": (inner, hidden),
        "bbox_embed.layers.1": (inner, inner), "bbox_embed.layers.2": (4, inner)}
    tensors = {}
    for module, (rows, cols) in shapes.items():
        prefix = f"{PEFT_MODULE_PREFIX}task_head.{module}"
        tensors[f"{prefix}.weight"] = torch.randn(rows, cols, generator=generator) * HEAD_INIT_STD / cols ** 0.5
        tensors[f"{prefix}.bias"] = torch.randn(rows, generator=generator) * HEAD_INIT_STD
    return tensors


def add_head_files(adapter_dir: Path, head: DemoHead, hidden: int, seed: int) -> None:
    """Add `head` to the saved adapter in `adapter_dir` (a staging directory: rewritten in place)."""
    config_path = adapter_dir / CONFIG_FILE
    config = json.loads(config_path.read_text())
    config.update(head_config(head))
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    if head.kind != "classifier":  # PEFT saved the SEQ_CLS score itself
        weights_path = adapter_dir / WEIGHTS_FILE
        tensors = load_file(weights_path)
        tensors.update(valora_head_tensors(head, hidden, torch.Generator().manual_seed(seed)))
        save_file(tensors, weights_path)
