"""Task heads: a small trained module an adapter may carry in place of the LM head (VaLoRA's vision task
heads; PEFT's SEQ_CLS). A head request runs one pass over its prompt; the head reads the final hidden
states (after the last norm) of the prompt's last `positions` tokens and answers a class or boxes.
The file format, for users writing one (docs/task-heads.md):

    classifier  PEFT SEQ_CLS. adapter_config.json: "task_type": "SEQ_CLS", "modules_to_save": ["score"]
                (PEFT writes ["classifier", "score"]), optional "id2label": {"0": "cat", ...}.
                Tensors: base_model.model.score.weight [labels, hidden] (or classifier.weight), optional bias.
                probs = softmax(score(h_last)).
    mlp         VaLoRA's action-recognition head. "task_head": {"kind": "mlp", "labels": [...],
                "activation": "none" | "relu" | "gelu" | "tanh"}. Tensors under base_model.model.task_head.:
                fc1.weight [inner, hidden], fc1.bias, fc2.weight [labels, inner], fc2.bias.
                probs = softmax(fc2(act(fc1(h_last)))).
    detection   DETR-style, on the last `num_queries` positions. "task_head": {"kind": "detection",
                "labels": [...], "num_queries": K, "box_format": "cxcywh" | "xyxy", "score_threshold": 0.5}.
                Tensors under base_model.model.task_head.: class_embed.weight [labels + 1, hidden] (the last
                class: no object), class_embed.bias, bbox_embed.layers.{0,1,2}.weight/bias (hidden -> d -> d
                -> 4, ReLU between). Each query: softmax over the classes, the best real label and its
                probability, sigmoid(bbox_embed) as a box in `box_format`, answered as [x1, y1, x2, y2].

The registry derives a TaskHead from the adapter's files at registration and keeps it as the adapter's
`task_head` (JSON): the gateway answers head and generation requests by it, the worker sizes its tiers by
`num_params`. The head's tensors are part of adapter_model.safetensors: checksummed with the adapter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidArgument

PEFT_MODULE_PREFIX = "base_model.model."
SEQ_CLS_MODULES = ("score", "classifier")  # PEFT's modules_to_save for SEQ_CLS
VALORA_PREFIX = "task_head."
KINDS = ("classifier", "mlp", "detection")
ACTIVATIONS = ("none", "relu", "gelu", "tanh")
BOX_FORMATS = ("cxcywh", "xyxy")
MAX_LABELS = 4096
MAX_QUERIES = 256
MAX_LABEL_CHARS = 128


@dataclass(frozen=True)
class TaskHead:
    kind: str
    labels: tuple[str, ...]
    # Its tensors, by name under base_model.model. ("score.weight", "task_head.fc1.bias"), in packing order.
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    positions: int = 1            # the prompt's last tokens it reads (detection: num_queries)
    activation: str = "none"      # mlp: between fc1 and fc2
    box_format: str = "cxcywh"    # detection: what bbox_embed was trained to predict
    score_threshold: float = 0.5  # detection: boxes whose label probability is below are left out

    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for _, shape in self.tensors)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "labels": list(self.labels), "positions": self.positions,
                "activation": self.activation, "box_format": self.box_format,
                "score_threshold": self.score_threshold,
                # Pairs, not an object: their order is the packing order, and JSON stores may sort an object's keys.
                "tensors": [[name, list(shape)] for name, shape in self.tensors]}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> TaskHead:
        """The registry's record (to_json's output) back; trusted: the registry validated it."""
        return cls(value["kind"], tuple(value["labels"]),
                   tuple((name, tuple(shape)) for name, shape in value["tensors"]), value["positions"],
                   value["activation"], value["box_format"], value["score_threshold"])


def task_head_from_record(task_head_json: str) -> TaskHead | None:
    """The Adapter message's task_head_json: "" for an adapter without a head."""
    return TaskHead.from_json(json.loads(task_head_json)) if task_head_json else None


def is_head_tensor(name: str) -> bool:
    """Whether a safetensors name belongs to a task head rather than to LoRA."""
    module = name.removeprefix(PEFT_MODULE_PREFIX)
    return name.startswith(PEFT_MODULE_PREFIX) and (
        module.startswith(VALORA_PREFIX) or module.split(".", 1)[0] in SEQ_CLS_MODULES)


def allows_modules_to_save(config: Mapping[str, Any]) -> bool:
    """PEFT's modules_to_save holds the SEQ_CLS head: served as a classifier head."""
    modules = config.get("modules_to_save")
    return (config.get("task_type") == "SEQ_CLS" and isinstance(modules, list) and bool(modules)
            and all(m in SEQ_CLS_MODULES for m in modules))


def parse_task_head(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], hidden_size: int,
                    where: str = "adapter_config.json") -> TaskHead | None:
    """The head an adapter carries, from its parsed config and its tensors' shapes (full names); None for
    none. InvalidArgument names what does not fit: a declared head without its tensors, tensors without a
    declaration, shapes against the base model's hidden size, labels against the head's rows."""
    head_shapes = {name.removeprefix(PEFT_MODULE_PREFIX): tuple(shape) for name, shape in shapes.items()
                   if is_head_tensor(name)}
    declared = config.get("task_head")
    if declared is not None:
        if not isinstance(declared, dict):
            raise InvalidArgument(f"{where}: task_head must be an object, got {declared!r}")
        return _valora_head(declared, head_shapes, hidden_size, where)
    if config.get("task_type") == "SEQ_CLS":
        return _classifier_head(config, head_shapes, hidden_size, where)
    if head_shapes:
        raise InvalidArgument(f"the adapter holds head tensors ({sorted(head_shapes)[0]!r}, ...) but {where} declares "
                              "no head: set task_type 'SEQ_CLS' (a score head) or task_head (docs/task-heads.md)")
    return None


def _classifier_head(config: Mapping[str, Any], shapes: dict[str, tuple[int, ...]], hidden: int,
                     where: str) -> TaskHead:
    modules = {name.split(".", 1)[0] for name in shapes}
    if len(modules) != 1 or not modules <= set(SEQ_CLS_MODULES):
        raise InvalidArgument(f"a SEQ_CLS adapter holds exactly one head module, 'score' or 'classifier'; "
                              f"found {sorted(modules) or 'none'}")
    module = modules.pop()
    weight = shapes.get(f"{module}.weight")
    if weight is None or len(weight) != 2 or weight[1] != hidden:
        raise InvalidArgument(f"head tensor {module}.weight has shape {list(weight) if weight else None}, "
                              f"expected [num_labels, {hidden}] (the base model's hidden size)")
    num_labels = weight[0]
    expected = {f"{module}.weight": weight}
    if f"{module}.bias" in shapes:
        expected[f"{module}.bias"] = (num_labels,)
    _check_shapes(shapes, expected)
    labels = _id2label(config.get("id2label"), num_labels, where)
    return TaskHead("classifier", labels, tuple(expected.items()))


def _id2label(value: Any, num_labels: int, where: str) -> tuple[str, ...]:
    """transformers' id2label ({"0": "cat"}); absent: LABEL_0, LABEL_1, ... as transformers names them."""
    if value is None:
        return tuple(f"LABEL_{i}" for i in range(num_labels))
    if not isinstance(value, dict) or sorted(value, key=str) != sorted((str(i) for i in range(num_labels)), key=str):
        raise InvalidArgument(f"{where}: id2label must map each label index 0..{num_labels - 1} (the head's "
                              f"rows) to a name, got {str(value)[:200]}")
    return _labels([value[str(i)] for i in range(num_labels)], where, "id2label")


def _labels(value: Any, where: str, field: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_LABELS:
        raise InvalidArgument(f"{where}: {field} must be a list of 1 to {MAX_LABELS} label names")
    for label in value:
        if not isinstance(label, str) or not 1 <= len(label) <= MAX_LABEL_CHARS or not label.isprintable():
            raise InvalidArgument(f"{where}: {field} holds {str(label)[:40]!r}; a label is 1 to "
                                  f"{MAX_LABEL_CHARS} printable characters")
    if len(set(value)) != len(value):
        raise InvalidArgument(f"{where}: {field} names a label twice")
    return tuple(value)


def _valora_head(declared: dict[str, Any], shapes: dict[str, tuple[int, ...]], hidden: int, where: str) -> TaskHead:
    fields = {"mlp": {"kind", "labels", "activation"},
              "detection": {"kind", "labels", "num_queries", "box_format", "score_threshold"}}
    kind = declared.get("kind")
    if kind not in fields:
        raise InvalidArgument(f"{where}: task_head.kind must be 'mlp' or 'detection', got {kind!r} "
                              "(a PEFT score head: task_type 'SEQ_CLS')")
    unknown = sorted(set(declared) - fields[kind])
    if unknown:
        raise InvalidArgument(f"{where}: task_head has unknown field {unknown[0]!r} for kind {kind!r}; "
                              f"known: {', '.join(sorted(fields[kind]))}")
    labels = _labels(declared.get("labels"), where, "task_head.labels")
    n = len(labels)
    p = VALORA_PREFIX
    if kind == "mlp":
        activation = declared.get("activation", "none")
        if activation not in ACTIVATIONS:
            raise InvalidArgument(f"{where}: task_head.activation must be one of {', '.join(ACTIVATIONS)}")
        inner = shapes.get(f"{p}fc1.weight", (0, 0))[0]
        expected = {f"{p}fc1.weight": (inner, hidden), f"{p}fc1.bias": (inner,),
                    f"{p}fc2.weight": (n, inner), f"{p}fc2.bias": (n,)}
        _check_shapes(shapes, expected)
        return TaskHead("mlp", labels, tuple(expected.items()), activation=activation)
    queries = declared.get("num_queries")
    if not isinstance(queries, int) or isinstance(queries, bool) or not 1 <= queries <= MAX_QUERIES:
        raise InvalidArgument(f"{where}: task_head.num_queries must be an integer from 1 to {MAX_QUERIES}")
    box_format = declared.get("box_format", "cxcywh")
    if box_format not in BOX_FORMATS:
        raise InvalidArgument(f"{where}: task_head.box_format must be one of {', '.join(BOX_FORMATS)}")
    threshold = declared.get("score_threshold", 0.5)
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0 <= threshold <= 1:
        raise InvalidArgument(f"{where}: task_head.score_threshold must be a number in [0, 1]")
    inner = shapes.get(f"{p}bbox_embed.layers.0.weight", (0, 0))[0]
    expected = {f"{p}class_embed.weight": (n + 1, hidden), f"{p}class_embed.bias": (n + 1,),
                f"{p}bbox_embed.layers.0.weight": (inner, hidden), f"{p}bbox_embed.layers.0.bias": (inner,),
                f"{p}bbox_embed.layers.1.weight": (inner, inner), f"{p}bbox_embed.layers.1.bias": (inner,),
                f"{p}bbox_embed.layers.2.weight": (4, inner), f"{p}bbox_embed.layers.2.bias": (4,)}
    _check_shapes(shapes, expected)
    return TaskHead("detection", labels, tuple(expected.items()), positions=queries, box_format=box_format,
                    score_threshold=float(threshold))


def _check_shapes(shapes: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> None:
    for name, shape in expected.items():
        if name not in shapes:
            raise InvalidArgument(f"the head lacks tensor {PEFT_MODULE_PREFIX}{name} (shape {list(shape)})")
        if 0 in shape or shapes[name] != shape:
            raise InvalidArgument(f"head tensor {PEFT_MODULE_PREFIX}{name} has shape {list(shapes[name])}, expected "
                                  f"{list(shape)} (hidden size and label count from the base model and the config)")
    extra = sorted(set(shapes) - set(expected))
    if extra:
        raise InvalidArgument(f"unexpected head tensor {PEFT_MODULE_PREFIX}{extra[0]} for this head kind")
