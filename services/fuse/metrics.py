"""Each task's metric over generated answers (docs/fuse.md): exact match of the stripped text for generation
and classification; mAP@0.5 for detection, its boxes parsed from the generated lines.

    parse_boxes("square 0.10 0.20 0.40 0.50\nhello") -> [("square", (0.1, 0.2, 0.4, 0.5))]  (a bad line: no box)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from services.fuse.data import Box, Example
from services.fuse.manifest import Task
from services.fuse.prompt import target_text

IOU_THRESHOLD = 0.5
ParsedBox = tuple[str, tuple[float, float, float, float]]


def parse_boxes(text: str, labels: Sequence[str]) -> list[ParsedBox]:
    """The boxes of generated `text`, one a line ("label x1 y1 x2 y2"); a line that is not one counts as none."""
    boxes: list[ParsedBox] = []
    for line in text.strip().splitlines():
        fields = line.split()
        if len(fields) != 5 or fields[0] not in labels:
            continue
        try:
            x1, y1, x2, y2 = (float(f) for f in fields[1:])
        except ValueError:
            continue
        if all(math.isfinite(c) for c in (x1, y1, x2, y2)) and x1 <= x2 and y1 <= y2:
            boxes.append((fields[0], (x1, y1, x2, y2)))
    return boxes


def iou(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> float:
    width = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = width * height
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _average_precision(predicted: list[tuple[int, int, tuple[float, float, float, float]]],
                       truth: list[list[tuple[float, float, float, float]]]) -> float:
    """AP of one label, VOC style (all-point interpolation). `predicted`: (image, rank in its answer, box);
    generated boxes have no scores, so an answer's earlier lines rank first. `truth`: each image's boxes."""
    positives = sum(len(boxes) for boxes in truth)
    if positives == 0:
        return 1.0 if not predicted else 0.0
    matched = [[False] * len(boxes) for boxes in truth]
    hits: list[bool] = []
    for image, _, box in sorted(predicted, key=lambda p: p[1]):
        overlaps = [iou(box, t) for t in truth[image]]
        best = max(range(len(overlaps)), key=overlaps.__getitem__, default=None)
        hit = best is not None and overlaps[best] >= IOU_THRESHOLD and not matched[image][best]
        if hit:
            matched[image][best] = True
        hits.append(hit)
    precision, recall, true = [], [], 0
    for n, hit in enumerate(hits, start=1):
        true += hit
        precision.append(true / n)
        recall.append(true / positives)
    ap, previous_recall = 0.0, 0.0
    for i, r in enumerate(recall):  # area under the interpolated curve: max precision at recall >= r
        ap += (r - previous_recall) * max(precision[i:])
        previous_recall = r
    return ap


def map50(answers: Sequence[str], truths: Sequence[tuple[Box, ...]], labels: Sequence[str]) -> float:
    """mAP@0.5 over the task's labels that occur in the truth or the answers."""
    parsed = [parse_boxes(text, labels) for text in answers]
    aps = []
    for label in labels:
        truth = [[b.box for b in boxes if b.label == label] for boxes in truths]
        predicted = [(image, rank, box) for image, boxes in enumerate(parsed)
                     for rank, (name, box) in enumerate(boxes) if name == label]
        if predicted or any(truth):
            aps.append(_average_precision(predicted, truth))
    return sum(aps) / len(aps) if aps else 1.0


def score(task: Task, examples: Sequence[Example], answers: Sequence[str]) -> float:
    """`task`'s metric in [0, 1] for the generated `answers`, one per example."""
    assert len(examples) == len(answers) and examples, "one answer per example, at least one"
    if task.type == "detection":
        return map50(answers, [e.boxes or () for e in examples], task.labels)
    return sum(a.strip() == target_text(e, task) for e, a in zip(examples, answers)) / len(examples)
