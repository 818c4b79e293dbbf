"""The metrics of served answers: exact match after stripping, and mAP@0.5 over boxes parsed from lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.fuse.data import Box, Example
from services.fuse.manifest import Task
from services.fuse.metrics import map50, parse_boxes, score
from services.fuse.prompt import target_text

SQUARE = Box("square", (0.1, 0.2, 0.4, 0.5))
OTHER = Box("square", (0.6, 0.6, 0.9, 0.9))


def _task(task_type: str, labels: tuple[str, ...]) -> Task:
    metric = {"generation": "exact_match", "classification": "accuracy", "detection": "map50"}[task_type]
    return Task("t", task_type, labels, Path("x"), Path("x"), metric, 0.5)  # type: ignore[arg-type]


def test_target_text_writes_boxes_one_a_line_with_two_decimals() -> None:
    example = Example(1, "Find the squares.", boxes=(SQUARE, OTHER))
    assert target_text(example, _task("detection", ("square",))) == "square 0.10 0.20 0.40 0.50\nsquare 0.60 0.60 0.90 0.90"


def test_parse_boxes_skips_unparsable_lines() -> None:
    text = "square 0.10 0.20 0.40 0.50\nsquare 0.1 0.2\ncircle 0 0 1 1\nsquare a b c d\nsquare 0.5 0.5 0.1 0.1"
    assert parse_boxes(text, ("square",)) == [("square", (0.1, 0.2, 0.4, 0.5))]


def test_map50() -> None:
    truths = [(SQUARE,), (SQUARE, OTHER)]
    assert map50(["square 0.10 0.20 0.40 0.50", "square 0.60 0.60 0.90 0.90\nsquare 0.1 0.2 0.4 0.5"], truths,
                 ("square",)) == 1.0
    assert map50(["nothing", "nothing"], truths, ("square",)) == 0.0
    # One of three boxes found, first: precision 1 at recall 1/3.
    assert map50(["square 0.11 0.21 0.41 0.51", "junk"], truths, ("square",)) == pytest.approx(1 / 3)
    # A box of the wrong place ranks first: precision 1/2 at recall 1/3.
    assert map50(["square 0.70 0.00 0.80 0.10", "square 0.60 0.60 0.90 0.90"], truths,
                 ("square",)) == pytest.approx(1 / 6)


def test_exact_match_strips_whitespace() -> None:
    task = _task("classification", ("circle", "square"))
    examples = [Example(1, "?", label="circle"), Example(2, "?", label="square")]
    assert score(task, examples, [" circle\n", "circle"]) == 0.5
