"""Adapters carrying task heads for the registry's tests, written as docs/task-heads.md tells users to: LoRA
tensors under their PEFT names plus the head's tensors, with plain torch and safetensors (PEFT's own SEQ_CLS
adapters are built in conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HIDDEN = 64      # the tiny base model's hidden size (conftest.py)
NUM_LAYERS = 2
RANK = 2
QV_OUT_FEATURES = {"q_proj": 64, "v_proj": 32}  # 4 heads x 16; 2 kv heads x 16

Shapes = dict[str, tuple[int, ...]]


def mlp_head(num_labels: int, inner: int = 16, hidden: int = HIDDEN) -> Shapes:
    """VaLoRA's MLP head, by name under base_model.model."""
    return {"task_head.fc1.weight": (inner, hidden), "task_head.fc1.bias": (inner,),
            "task_head.fc2.weight": (num_labels, inner), "task_head.fc2.bias": (num_labels,)}


def detection_head(num_labels: int, inner: int = 16, hidden: int = HIDDEN) -> Shapes:
    """The DETR-style head: class_embed has a row per label and one for "no object"."""
    return {"task_head.class_embed.weight": (num_labels + 1, hidden), "task_head.class_embed.bias": (num_labels + 1,),
            "task_head.bbox_embed.layers.0.weight": (inner, hidden), "task_head.bbox_embed.layers.0.bias": (inner,),
            "task_head.bbox_embed.layers.1.weight": (inner, inner), "task_head.bbox_embed.layers.1.bias": (inner,),
            "task_head.bbox_embed.layers.2.weight": (4, inner), "task_head.bbox_embed.layers.2.bias": (4,)}


def write_head_adapter(directory: Path, head: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> None:
    """A q/v LoRA adapter (r=2) on the tiny base model plus `head`'s tensors (names under base_model.model.,
    random values); `config`: what adapter_config.json holds beside the LoRA fields ("task_head", ...)."""
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for layer in range(NUM_LAYERS):
        for module, out_features in QV_OUT_FEATURES.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, HIDDEN)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, RANK)
    tensors.update({f"base_model.model.{name}": torch.randn(shape) for name, shape in head.items()})
    directory.mkdir(parents=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    lora = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(QV_OUT_FEATURES)}
    (directory / "adapter_config.json").write_text(json.dumps({**lora, **config}))
