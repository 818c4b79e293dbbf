"""A task's JSONL examples (docs/fuse.md): the doc's records parse, and every refusal names the file and
the line; record paths stay inside the file's directory and name PNG, JPEG or WebP images."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.fuse import data
from services.fuse.data import Box, Example, FuseDataError, load_examples
from services.fuse.manifest import Task, TaskType

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
JPEG = b"\xff\xd8\xff\xe0" + b"\0" * 16
WEBP = b"RIFF\x10\0\0\0WEBPVP8 " + b"\0" * 16


def _task(task_type: TaskType, labels: tuple[str, ...] = ("circle", "square", "left")) -> Task:
    metric = {"generation": "exact_match", "classification": "accuracy", "detection": "map50"}[task_type]
    return Task(name="shape", type=task_type, labels=() if task_type == "generation" else labels,
                train=Path("unused"), eval=Path("unused"), metric=metric, floor=0.5)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / "img").mkdir()
    for name, content in (("0001.png", PNG), ("0002.jpg", JPEG), ("0003.webp", WEBP),
                          *((f"v1-{i}.png", PNG) for i in range(4)), ("fake.png", b"GIF89a" + b"\0" * 16)):
        (tmp_path / "img" / name).write_bytes(content)
    return tmp_path


def _write(home: Path, *lines: object) -> Path:
    path = home / "task.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_the_docs_records_parse_to_examples(home):
    img = home.resolve() / "img"
    frames = [f"img/v1-{i}.png" for i in range(4)]
    path = _write(home, {"prompt": "What shape is this?", "images": ["img/0001.png"], "label": "circle"},
                  {"prompt": "Which way does it move?", "video": frames, "label": "left"},
                  {"prompt": "And this one?", "images": ["img/0002.jpg", "img/0003.webp"], "label": "square"})
    assert load_examples(path, _task("classification")) == [
        Example(line=1, prompt="What shape is this?", images=(img / "0001.png",), label="circle"),
        Example(line=2, prompt="Which way does it move?", video=tuple(img / f"v1-{i}.png" for i in range(4)),
                label="left"),
        Example(line=3, prompt="And this one?", images=(img / "0002.jpg", img / "0003.webp"), label="square")]
    path = _write(home, {"prompt": "How many squares?", "images": ["img/0001.png"], "answer": "3"},
                  {"prompt": "Say hi.", "answer": "hi"})
    assert load_examples(path, _task("generation")) == [
        Example(line=1, prompt="How many squares?", images=(img / "0001.png",), answer="3"),
        Example(line=2, prompt="Say hi.", answer="hi")]
    path = _write(home, {"prompt": "Find the squares.", "images": ["img/0001.png"],
                         "boxes": [{"label": "square", "box": [0.1, 0.2, 0.4, 0.5]}, {"label": "circle",
                                                                                     "box": [0, 0, 1, 1]}]},
                  {"prompt": "Find the squares.", "images": ["img/0001.png"], "boxes": []})
    assert load_examples(path, _task("detection")) == [
        Example(line=1, prompt="Find the squares.", images=(img / "0001.png",),
                boxes=(Box("square", (0.1, 0.2, 0.4, 0.5)), Box("circle", (0.0, 0.0, 1.0, 1.0)))),
        Example(line=2, prompt="Find the squares.", images=(img / "0001.png",), boxes=())]


GOOD = {"prompt": "What shape is this?", "images": ["img/0001.png"], "label": "circle"}
GOOD_BOXES = {"prompt": "Find them.", "images": ["img/0001.png"], "boxes": [{"label": "square", "box": [0, 0, 1, 1]}]}

# (task type, the refused line, what the message says after "task.jsonl:2: ")
REFUSALS = [
    ("classification", "not json", "the line is not valid JSON"),
    ("classification", '{"prompt": "x", "label": NaN}', "NaN is not allowed"),
    ("classification", "[1, 2]", "a record must be a JSON object"),
    ("classification", "   ", "line is empty"),
    ("classification", {**GOOD, "weight": 2}, "unknown fields 'weight'"),
    ("classification", {**GOOD, "answer": "3"}, "unknown fields 'answer'"),
    ("classification", {"images": ["img/0001.png"], "label": "circle"}, "prompt is missing"),
    ("classification", {"prompt": "x"}, "label is missing"),
    ("classification", {**GOOD, "prompt": ""}, "prompt must be non-empty text"),
    ("classification", {**GOOD, "prompt": "  \n"}, "prompt must be non-empty text"),
    ("classification", {**GOOD, "prompt": 3}, "prompt must be non-empty text"),
    ("classification", {**GOOD, "prompt": "x" * (data.MAX_TEXT_CHARS + 1)}, "prompt must be non-empty text"),
    ("classification", {**GOOD, "prompt": "a\u0000b"}, "NUL"),
    ("classification", {**GOOD, "video": ["img/v1-0.png"]}, "images or a video, not both"),
    ("classification", {**GOOD, "images": []}, "images must be a list of 1 to"),
    ("classification", {**GOOD, "images": "img/0001.png"}, "images must be a list of 1 to"),
    ("classification", {**GOOD, "images": ["img/0001.png"] * (data.MAX_IMAGES + 1)}, "images must be a list of 1"),
    ("classification", {**GOOD, "images": [3]}, "3 is not a path"),
    ("classification", {**GOOD, "images": ["img/fake.png"]}, "'img/fake.png' is not a PNG, JPEG or WebP image"),
    ("classification", {**GOOD, "images": ["img/none.png"]}, "path 'img/none.png' does not exist"),
    ("classification", {**GOOD, "images": ["img"]}, "path 'img' is not a regular file"),
    ("classification", {**GOOD, "images": ["/etc/passwd"]}, "path '/etc/passwd' is absolute"),
    ("classification", {**GOOD, "images": ["img/../img/0001.png"]}, "holds '..'"),
    ("classification", {**GOOD, "label": "hexagon"}, "label 'hexagon' is not one of the task's labels"),
    ("classification", {**GOOD, "label": ["circle"]}, "label ['circle'] is not one of the task's labels"),
    ("generation", {"prompt": "x", "answer": 3}, "answer must be non-empty text"),
    ("generation", {"prompt": "x", "label": "circle"}, "unknown fields 'label'"),
    ("detection", {**GOOD_BOXES, "boxes": {"label": "square"}}, "boxes must be a list"),
    ("detection", {**GOOD_BOXES, "boxes": [{"label": "hexagon", "box": [0, 0, 1, 1]}]}, "box label 'hexagon' is not"),
    ("detection", {**GOOD_BOXES, "boxes": [{"label": "square"}]}, "exactly 'label' and 'box'"),
    ("detection", {**GOOD_BOXES, "boxes": [{"label": "square", "box": [0, 0, 1, 1], "score": 1}]}, "exactly"),
    ("detection", {**GOOD_BOXES, "boxes": [{"label": "square", "box": [0, 0, 1]}]}, "four numbers"),
    ("detection", {**GOOD_BOXES, "boxes": [{"label": "square", "box": [0, 0, True, 1]}]}, "four numbers"),
    ("detection", {**GOOD_BOXES, "boxes": [{"label": "square", "box": [0.5, 0, 0.4, 1]}]}, "0 <= x1 <= x2 <= 1"),
    ("detection", {**GOOD_BOXES, "boxes": [{"label": "square", "box": [0, 0.6, 1, 0.5]}]}, "0 <= y1 <= y2 <= 1"),
    ("detection", {**GOOD_BOXES, "boxes": [{"label": "square", "box": [-0.1, 0, 1, 1]}]}, "0 <= x1"),
    ("detection", {**GOOD_BOXES, "boxes": [{"label": "square", "box": [0, 0, 1, 1.5]}]}, "y2 <= 1"),
]


@pytest.mark.parametrize("task_type, line, message", REFUSALS, ids=[str(r[1])[:50] for r in REFUSALS])
def test_each_refusal_names_the_file_and_line(home, task_type, line, message):
    first = GOOD_BOXES if task_type == "detection" else {"prompt": "x", "answer": "y"} \
        if task_type == "generation" else GOOD
    path = _write(home, first, line)
    with pytest.raises(FuseDataError) as caught:
        load_examples(path, _task(task_type))
    assert str(caught.value).startswith(f"{path}:2: "), str(caught.value)
    assert message in str(caught.value), str(caught.value)


def test_an_image_linked_from_outside_the_files_directory_is_refused(home, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside") / "secret.png"
    outside.write_bytes(PNG)
    (home / "img" / "link.png").symlink_to(outside)
    path = _write(home, {**GOOD, "images": ["img/link.png"]})
    with pytest.raises(FuseDataError, match=f"^{path}:1: path 'img/link.png' leaves"):
        load_examples(path, _task("classification"))


def test_an_image_linked_from_inside_is_followed_and_checked_by_its_bytes(home):
    (home / "img" / "alias.webp").symlink_to(home / "img" / "0001.png")  # a PNG under any name
    path = _write(home, {**GOOD, "images": ["img/alias.webp"]})
    assert load_examples(path, _task("classification"))[0].images == ((home / "img" / "0001.png").resolve(),)
    (home / "img" / "renamed.png").write_bytes(PNG[:4])  # a PNG's first bytes, cut short
    path = _write(home, {**GOOD, "images": ["img/renamed.png"]})
    with pytest.raises(FuseDataError, match="is not a PNG, JPEG or WebP image"):
        load_examples(path, _task("classification"))


def test_an_empty_file_is_refused_naming_it(home):
    path = home / "task.jsonl"
    path.write_bytes(b"")
    with pytest.raises(FuseDataError, match=f"^{path}:1: holds no examples"):
        load_examples(path, _task("classification"))


def test_a_line_over_the_byte_limit_is_refused_without_reading_it_whole(home, monkeypatch):
    monkeypatch.setattr(data, "MAX_LINE_BYTES", 100)
    record = json.dumps(GOOD)
    path = _write(home, record, record + " " * (100 - len(record)), record + " " * (101 - len(record)))
    with pytest.raises(FuseDataError, match=f"^{path}:3: line is longer than 100 bytes"):
        load_examples(path, _task("classification"))


def test_more_examples_than_the_limit_are_refused(home, monkeypatch):
    monkeypatch.setattr(data, "MAX_EXAMPLES", 2)
    path = _write(home, GOOD, GOOD)
    assert len(load_examples(path, _task("classification"))) == 2
    path = _write(home, GOOD, GOOD, GOOD)
    with pytest.raises(FuseDataError, match=f"^{path}:3: more than 2 examples"):
        load_examples(path, _task("classification"))
