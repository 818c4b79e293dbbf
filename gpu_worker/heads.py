"""Adapters' task heads applied to a step's hidden states, and their answers on their way to the host.

A head request's prompt runs through the model like any prefill (its adapter's LoRA included, batched with
every other request of the step); the final hidden states at the head's positions go through the head
(services/common/task_heads.py) instead of the LM head. Heads are tiny next to a step (a few hundred
thousand multiply-adds a request), so each runs on its own rows, in float32; requests of one adapter in a
step share one call. The answers reach the host with one asynchronous copy, like sampled tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.lora.loader import HeadWeights
from gpu_worker.sequence import Sequence
from services.common.task_heads import TaskHead

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda x: x, "relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh}


@dataclass(frozen=True)
class Detection:
    label_index: int
    label: str
    score: float
    box: tuple[float, float, float, float]  # x1, y1, x2, y2 as fractions of the image's width and height


@dataclass(frozen=True)
class HeadAnswer:
    """One request's answer: a classification's probabilities and label, or a detection's boxes."""
    probs: tuple[float, ...] = ()
    label_index: int = 0
    label: str = ""
    detections: tuple[Detection, ...] = ()


def _linear(x: torch.Tensor, weights: HeadWeights, name: str) -> torch.Tensor:
    tensors = weights.tensors
    bias = tensors.get(f"{name}.bias")
    return F.linear(x, tensors[f"{name}.weight"].float(), None if bias is None else bias.float())


def apply_head(weights: HeadWeights, hidden: torch.Tensor) -> torch.Tensor:
    """hidden: [requests, positions, hidden size], each request's states at the head's positions in order
    -> float32 [requests, width]: a classifier's label probabilities; per detection query, its class
    probabilities (labels + 1, the last "no object") then its box as x1, y1, x2, y2."""
    head, x = weights.head, hidden.float()
    if head.kind == "classifier":
        module = next(iter(weights.tensors)).split(".", 1)[0]  # "score" or "classifier"
        return torch.softmax(_linear(x[:, -1], weights, module), dim=-1)
    if head.kind == "mlp":
        inner = _ACTIVATIONS[head.activation](_linear(x[:, -1], weights, "task_head.fc1"))
        return torch.softmax(_linear(inner, weights, "task_head.fc2"), dim=-1)
    classes = torch.softmax(_linear(x, weights, "task_head.class_embed"), dim=-1)
    box = F.relu(_linear(x, weights, "task_head.bbox_embed.layers.0"))
    box = F.relu(_linear(box, weights, "task_head.bbox_embed.layers.1"))
    box = torch.sigmoid(_linear(box, weights, "task_head.bbox_embed.layers.2"))
    if head.box_format == "cxcywh":
        center, size = box[..., :2], box[..., 2:]
        box = torch.cat([center - size / 2, center + size / 2], dim=-1).clamp(0.0, 1.0)
    return torch.cat([classes, box], dim=-1).flatten(1)


def answer_of(head: TaskHead, values: list[float]) -> HeadAnswer:
    """One request's row of `apply_head`, on the host."""
    if head.kind != "detection":
        best = max(range(len(values)), key=values.__getitem__)
        return HeadAnswer(tuple(values), best, head.labels[best])
    width = len(head.labels) + 1 + 4
    detections = []
    for query in range(head.positions):
        row = values[query * width:(query + 1) * width]
        classes, box = row[:len(head.labels)], row[-4:]
        best = max(range(len(classes)), key=classes.__getitem__)  # "no object" is never answered
        if classes[best] >= head.score_threshold:
            detections.append(Detection(best, head.labels[best], classes[best], (box[0], box[1], box[2], box[3])))
    return HeadAnswer(detections=tuple(sorted(detections, key=lambda d: -d.score)))


class HeadAnswers:
    """One step's head answers: computed on the device, on the host at `result()`."""

    def __init__(self, answers: list[tuple[Sequence, torch.Tensor]]) -> None:
        self.seqs = [seq for seq, _ in answers]
        self._host = [values.to("cpu", non_blocking=True) for _, values in answers]
        self._ready: torch.cuda.Event | None = None
        if answers and answers[0][1].is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self) -> list[HeadAnswer]:
        if self._ready is not None:
            self._ready.synchronize()
        return [answer_of(seq.head, values.tolist()) for seq, values in zip(self.seqs, self._host)]
