"""A task's examples (docs/fuse.md): JSONL read line by line, each record checked against the task's type.

    {"prompt": "What shape is this?", "images": ["img/0001.png"], "label": "circle"}
    -> Example(line=1, prompt="What shape is this?", images=(Path(".../img/0001.png"),), label="circle")

Every refusal is a FuseDataError naming the file and the line:
    data/shape.train.jsonl:17: label 'hexagon' is not one of the task's labels
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common import strict_json
from services.common.errors import InvalidArgument
from services.common.text_fields import check_text
from services.fuse.manifest import Task
from services.fuse.paths import resolve_inside

MAX_LINE_BYTES = 1 << 20  # one record: a prompt, a target and a few dozen paths
MAX_EXAMPLES = 1_000_000
MAX_TEXT_CHARS = 16_384  # a prompt or an answer
MAX_IMAGES = 16
MAX_FRAMES = 64  # a video's
MAX_BOXES = 1024
TARGET_OF = {"generation": "answer", "classification": "label", "detection": "boxes"}
# The first bytes of each image format we take; WebP is a RIFF container whose form type is "WEBP".
_SIGNATURE_BYTES = 12


class FuseDataError(ValueError):
    """A refused data file; the message starts '<file>:<line>: '."""


@dataclass(frozen=True)
class Box:
    label: str  # one of the task's labels
    box: tuple[float, float, float, float]  # x1, y1, x2, y2: fractions of the image, x1 <= x2, y1 <= y2


@dataclass(frozen=True)
class Example:
    """One record; exactly the target of its task's type is set."""

    line: int
    prompt: str
    images: tuple[Path, ...] = ()  # resolved, inside the JSONL file's directory
    video: tuple[Path, ...] = ()  # frames in time order; never with images
    answer: str | None = None  # generation
    label: str | None = None  # classification
    boxes: tuple[Box, ...] | None = None  # detection


def _is_image(head: bytes) -> bool:
    return (head.startswith(b"\x89PNG\r\n\x1a\n") or head.startswith(b"\xff\xd8\xff")
            or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"))


def _image(root: Path, value: Any) -> Path:
    """The image file `value` names under `root`; ValueError saying why not."""
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a path")
    path = resolve_inside(root, value)
    # O_NONBLOCK: a FIFO swapped in after resolve_inside must not hang the open; fstat then checks what opened.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"path {value!r} cannot be opened ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"path {value!r} is not a regular file")
        head = os.read(fd, _SIGNATURE_BYTES)
    finally:
        os.close(fd)
    if not _is_image(head):
        raise ValueError(f"{value!r} is not a PNG, JPEG or WebP image")
    return path


def _text(record: dict[str, Any], field: str) -> str:
    value = record[field]
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_TEXT_CHARS:
        raise ValueError(f"{field} must be non-empty text of at most {MAX_TEXT_CHARS} characters")
    check_text(value, field)  # InvalidArgument: NUL or a lone surrogate
    return value


def _paths(root: Path, record: dict[str, Any], field: str, limit: int) -> tuple[Path, ...]:
    values = record[field]
    if not isinstance(values, list) or not 1 <= len(values) <= limit:
        raise ValueError(f"{field} must be a list of 1 to {limit} paths")
    return tuple(_image(root, value) for value in values)


def _box(item: Any, task: Task) -> Box:
    if not isinstance(item, dict) or set(item) != {"label", "box"}:
        raise ValueError(f"box {item!r} must be an object with exactly 'label' and 'box'")
    if item["label"] not in task.labels:
        raise ValueError(f"box label {item['label']!r} is not one of the task's labels")
    coords = item["box"]
    if (not isinstance(coords, list) or len(coords) != 4
            or any(isinstance(c, bool) or not isinstance(c, (int, float)) for c in coords)):
        raise ValueError(f"box {coords!r} must be [x1, y1, x2, y2], four numbers")
    x1, y1, x2, y2 = (float(c) for c in coords)
    if not (0 <= x1 <= x2 <= 1 and 0 <= y1 <= y2 <= 1):
        raise ValueError(f"box {coords!r} needs 0 <= x1 <= x2 <= 1 and 0 <= y1 <= y2 <= 1")
    return Box(label=item["label"], box=(x1, y1, x2, y2))


def _example(record: Any, line: int, root: Path, task: Task) -> Example:
    """ValueError (or InvalidArgument) saying what is wrong with the record; the caller adds file:line."""
    if not isinstance(record, dict):
        raise ValueError("a record must be a JSON object")
    target = TARGET_OF[task.type]
    unknown = sorted(set(record) - {"prompt", "images", "video", target})
    if unknown:
        raise ValueError(f"unknown fields {', '.join(map(repr, unknown))} (a {task.type} example has prompt, "
                         f"images or video, and {target})")
    for field in ("prompt", target):
        if field not in record:
            raise ValueError(f"{field} is missing")
    if "images" in record and "video" in record:
        raise ValueError("an example has images or a video, not both")
    prompt = _text(record, "prompt")
    images = _paths(root, record, "images", MAX_IMAGES) if "images" in record else ()
    video = _paths(root, record, "video", MAX_FRAMES) if "video" in record else ()
    if task.type == "generation":
        return Example(line=line, prompt=prompt, images=images, video=video, answer=_text(record, "answer"))
    if task.type == "classification":
        if record["label"] not in task.labels:
            raise ValueError(f"label {record['label']!r} is not one of the task's labels")
        return Example(line=line, prompt=prompt, images=images, video=video, label=record["label"])
    boxes = record["boxes"]
    if not isinstance(boxes, list) or len(boxes) > MAX_BOXES:
        raise ValueError(f"boxes must be a list of at most {MAX_BOXES} boxes")
    return Example(line=line, prompt=prompt, images=images, video=video,
                   boxes=tuple(_box(item, task) for item in boxes))


def load_examples(path: str | Path, task: Task) -> list[Example]:
    """Every example in the JSONL file at `path`, checked against `task`; FuseDataError on the first refusal."""
    path = Path(path)
    root = path.resolve().parent  # record paths are relative to the file's own directory
    examples: list[Example] = []
    try:
        f = path.open("rb")
    except OSError as exc:
        raise FuseDataError(f"{path}:1: cannot be read ({exc.strerror})") from exc
    with f:
        line = 0
        # readline with a bound: a file without newlines is read MAX_LINE_BYTES at a time, never whole.
        while raw := f.readline(MAX_LINE_BYTES + 1):
            line += 1
            where = f"{path}:{line}: "
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise FuseDataError(f"{where}line is longer than {MAX_LINE_BYTES} bytes")
            if len(examples) == MAX_EXAMPLES:
                raise FuseDataError(f"{where}more than {MAX_EXAMPLES} examples")
            if not raw.strip():
                raise FuseDataError(f"{where}line is empty; every line holds one example")
            try:
                examples.append(_example(strict_json.loads(raw, "the line"), line, root, task))
            except (ValueError, InvalidArgument) as exc:  # PathRefused is a ValueError
                message = exc.message if isinstance(exc, InvalidArgument) else str(exc)
                raise FuseDataError(where + message) from None
    if not examples:
        raise FuseDataError(f"{path}:1: holds no examples")
    return examples
