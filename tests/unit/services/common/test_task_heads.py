"""services/common/task_heads.py: each head kind parses from a config and its tensors' shapes; each refusal
names what does not fit."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.common.errors import InvalidArgument
from services.common.task_heads import (TaskHead, allows_modules_to_save, is_head_tensor, parse_task_head,
                                        task_head_from_record)

HIDDEN = 8
P = "base_model.model."
LORA = {f"{P}model.layers.0.self_attn.q_proj.lora_A.weight": (2, HIDDEN)}  # passed along: not a head's
SEQ_CLS = {"task_type": "SEQ_CLS", "modules_to_save": ["classifier", "score"]}


def mlp(labels: int, inner: int = 4, hidden: int = HIDDEN) -> dict[str, tuple[int, ...]]:
    return {f"{P}task_head.fc1.weight": (inner, hidden), f"{P}task_head.fc1.bias": (inner,),
            f"{P}task_head.fc2.weight": (labels, inner), f"{P}task_head.fc2.bias": (labels,)}


def detection(labels: int, inner: int = 4) -> dict[str, tuple[int, ...]]:
    head = {"class_embed.weight": (labels + 1, HIDDEN), "class_embed.bias": (labels + 1,),
            "bbox_embed.layers.0.weight": (inner, HIDDEN), "bbox_embed.layers.0.bias": (inner,),
            "bbox_embed.layers.1.weight": (inner, inner), "bbox_embed.layers.1.bias": (inner,),
            "bbox_embed.layers.2.weight": (4, inner), "bbox_embed.layers.2.bias": (4,)}
    return {f"{P}task_head.{name}": shape for name, shape in head.items()}


def test_a_plain_lora_adapter_has_no_head() -> None:
    assert parse_task_head({"peft_type": "LORA"}, LORA, HIDDEN) is None


def test_a_peft_score_head_is_a_classifier_named_by_id2label() -> None:
    config = {**SEQ_CLS, "id2label": {"0": "no", "1": "yes"}}
    head = parse_task_head(config, {**LORA, f"{P}score.weight": (2, HIDDEN)}, HIDDEN)
    assert head == TaskHead("classifier", ("no", "yes"), (("score.weight", (2, HIDDEN)),))
    assert (head.positions, head.num_params) == (1, 2 * HIDDEN)


def test_a_classifier_module_with_a_bias_and_no_id2label_takes_transformers_default_labels() -> None:
    shapes = {f"{P}classifier.weight": (3, HIDDEN), f"{P}classifier.bias": (3,)}
    head = parse_task_head(SEQ_CLS, shapes, HIDDEN)
    assert head is not None and head.labels == ("LABEL_0", "LABEL_1", "LABEL_2")
    assert head.tensors == (("classifier.weight", (3, HIDDEN)), ("classifier.bias", (3,)))


def test_an_mlp_head_parses_with_its_activation() -> None:
    config = {"task_head": {"kind": "mlp", "labels": ["a", "b", "c"], "activation": "relu"}}
    head = parse_task_head(config, {**LORA, **mlp(3)}, HIDDEN)
    assert head is not None and (head.kind, head.labels, head.activation, head.positions) == (
        "mlp", ("a", "b", "c"), "relu", 1)
    assert head.num_params == 4 * HIDDEN + 4 + 3 * 4 + 3


def test_a_detection_head_reads_num_queries_positions_with_defaults_for_the_rest() -> None:
    config = {"task_head": {"kind": "detection", "labels": ["person", "car"], "num_queries": 5}}
    head = parse_task_head(config, detection(2), HIDDEN)
    assert head is not None and (head.kind, head.positions, head.box_format, head.score_threshold) == (
        "detection", 5, "cxcywh", 0.5)
    assert [name for name, _ in head.tensors][:2] == ["task_head.class_embed.weight", "task_head.class_embed.bias"]


def test_a_head_survives_the_registry_record_and_the_proto_field() -> None:
    config = {"task_head": {"kind": "detection", "labels": ["x"], "num_queries": 3, "box_format": "xyxy",
                            "score_threshold": 0.25}}
    head = parse_task_head(config, detection(1), HIDDEN)
    assert head is not None
    assert task_head_from_record(json.dumps(head.to_json())) == head == TaskHead.from_json(head.to_json())
    assert task_head_from_record("") is None


@pytest.mark.parametrize("name, is_head", [
    (f"{P}score.weight", True), (f"{P}classifier.bias", True), (f"{P}task_head.fc1.weight", True),
    (f"{P}model.layers.0.self_attn.q_proj.lora_A.weight", False), ("score.weight", False),
    (f"{P}model.score.weight", False), (f"{P}scores.weight", False),
])
def test_head_tensors_are_named_under_the_peft_prefix(name: str, is_head: bool) -> None:
    assert is_head_tensor(name) is is_head


def test_modules_to_save_is_allowed_only_for_a_seq_cls_score_head() -> None:
    assert allows_modules_to_save(SEQ_CLS)
    assert not allows_modules_to_save({"task_type": "SEQ_CLS", "modules_to_save": ["lm_head"]})
    assert not allows_modules_to_save({"task_type": "CAUSAL_LM", "modules_to_save": ["score"]})
    assert not allows_modules_to_save({"task_type": "SEQ_CLS", "modules_to_save": []})


MLP = {"kind": "mlp", "labels": ["a", "b", "c"]}
DETECTION = {"kind": "detection", "labels": ["a", "b"], "num_queries": 4}


@pytest.mark.parametrize("config, shapes, message", [
    ({}, mlp(3), "holds head tensors ('task_head.fc1.bias', ...) but adapter_config.json declares no head"),
    ({"task_head": ["mlp"]}, mlp(3), "task_head must be an object"),
    ({"task_head": {**MLP, "kind": "segmentation"}}, mlp(3), "task_head.kind must be 'mlp' or 'detection'"),
    ({"task_head": {**MLP, "dropout": 0.1}}, mlp(3), "unknown field 'dropout' for kind 'mlp'"),
    ({"task_head": {**MLP, "activation": "swish"}}, mlp(3), "task_head.activation must be one of"),
    ({"task_head": {**MLP, "labels": []}}, mlp(3), "task_head.labels must be a list of 1 to 4096 label names"),
    ({"task_head": {**MLP, "labels": ["a", "a", "b"]}}, mlp(3), "task_head.labels names a label twice"),
    ({"task_head": {**MLP, "labels": ["a", "b\n", "c"]}}, mlp(3), "a label is 1 to 128 printable characters"),
    ({"task_head": MLP}, {}, "the head lacks tensor base_model.model.task_head.fc1.weight"),
    ({"task_head": MLP}, mlp(3, hidden=16), "task_head.fc1.weight has shape [4, 16], expected [4, 8]"),
    ({"task_head": MLP}, mlp(2), "task_head.fc2.weight has shape [2, 4], expected [3, 4]"),
    ({"task_head": MLP}, {**mlp(3), f"{P}task_head.fc3.weight": (3, 3)}, "unexpected head tensor"),
    ({"task_head": {**DETECTION, "num_queries": 0}}, detection(2), "num_queries must be an integer from 1 to 256"),
    ({"task_head": {**DETECTION, "num_queries": True}}, detection(2), "num_queries must be an integer"),
    ({"task_head": {**DETECTION, "box_format": "xywh"}}, detection(2), "box_format must be one of cxcywh, xyxy"),
    ({"task_head": {**DETECTION, "score_threshold": 1.5}}, detection(2), "score_threshold must be a number in [0, 1]"),
    ({"task_head": DETECTION}, detection(3), "class_embed.weight has shape [4, 8], expected [3, 8]"),
    (SEQ_CLS, {}, "exactly one head module, 'score' or 'classifier'; found none"),
    (SEQ_CLS, {f"{P}score.weight": (2, HIDDEN), f"{P}classifier.weight": (2, HIDDEN)}, "exactly one head module"),
    (SEQ_CLS, {f"{P}score.weight": (2, 16)}, "score.weight has shape [2, 16], expected [num_labels, 8]"),
    (SEQ_CLS, {f"{P}score.weight": (2, HIDDEN), f"{P}score.bias": (3,)}, "score.bias has shape [3], expected [2]"),
    ({**SEQ_CLS, "id2label": {"0": "no"}}, {f"{P}score.weight": (2, HIDDEN)}, "id2label must map each label index 0..1"),
])
def test_each_refusal_names_the_problem(config: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                                        message: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        parse_task_head(config, {**LORA, **shapes}, HIDDEN)
    assert message in str(refused.value)
