"""Builds the demo task suite of `tessera fuse` procedurally: small PNG pictures and 4-frame videos of coloured
shapes, JSONL data and a manifest in docs/fuse.md's format. Nothing is downloaded; a seed gives the same bytes.

Every picture is 48 x 48 px, a 3 x 3 grid of 16 px cells with at most one shape in a cell: the demo Qwen2-VL
takes 48 x 48 px unresized and makes one token of each 16 px cell (services/demo_assets.py, Qwen2VLVisionShape).

The tasks, in groups by what fusion should find (VaLoRA §4.2.1):
- meant to fuse, one shape in one of four cells, one question each about it:
  shape, colour, size (classification) and position (classification: left/right/top/bottom);
- meant to fuse, several shapes on the grid: count (generation: "1".."4"), odd-one-out (classification: which
  of three shapes in the middle row differs) and squares (detection: the squares' boxes);
- motion (classification: left/right/up/down over four video frames): video, which VaLoRA's Fig. 5 finds
  fuses worse than images; its own adapter or a late joiner;
- meant to interfere: position-flipped asks position's question about position's very pictures and answers
  as seen from the opposite side (left <-> right, top <-> bottom). No adapter can hold both at floors above
  0.5, so one adapter for all tasks misses a floor while greedy fusion needs about three or four adapters.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml
from PIL import Image, ImageDraw

from services.demo_assets import DEMO_QWEN2VL_BASE_MODEL

IMAGE_SIZE = 48
CELL = 16       # IMAGE_SIZE / 3: one Qwen2-VL token
BIG, SMALL = 14, 8  # a shape's side in px
BACKGROUND = (20, 20, 20)
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 90, 230), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")
# The one shape of a single-shape picture sits in one of these (row, column) cells.
POSITIONS = {"left": (1, 0), "right": (1, 2), "top": (0, 1), "bottom": (2, 1)}
FLIPPED = {"left": "right", "right": "left", "top": "bottom", "bottom": "top"}
MOTION_FRAMES, MOTION_STEP = 4, 8  # px per frame: 24 px over the clip
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
MANIFEST = "manifest.yaml"

# Every adapter's settings: docs/fuse.md's defaults.
TRAINING = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "tower": False, "epochs": 3,
            "learning_rate": 0.001, "batch_size": 8}


@dataclass(frozen=True)
class Shape:
    kind: str       # one of SHAPES
    colour: str     # a key of COLOURS
    box: tuple[int, int, int, int]  # (x0, y0, x1, y1) px, x1 and y1 exclusive


@dataclass(frozen=True)
class Example:
    frames: tuple[tuple[Shape, ...], ...]  # one picture, or MOTION_FRAMES video frames
    target: dict[str, object]              # {"label": ...}, {"answer": ...} or {"boxes": [...]}


@dataclass(frozen=True)
class DemoTask:
    name: str
    type: str                   # generation | classification | detection
    labels: tuple[str, ...]     # () for generation
    metric: str
    floor: float
    prompt: str
    stream: str                 # the random stream: tasks of one stream get the same pictures
    make: Callable[[random.Random], Example]


def _shape_in_cell(rng: random.Random, row: int, column: int, kind: str, colour: str, side: int) -> Shape:
    x0 = column * CELL + rng.randint(0, CELL - side)
    y0 = row * CELL + rng.randint(0, CELL - side)
    return Shape(kind, colour, (x0, y0, x0 + side, y0 + side))


def _random_shape(rng: random.Random, row: int, column: int) -> Shape:
    return _shape_in_cell(rng, row, column, rng.choice(SHAPES), rng.choice(sorted(COLOURS)), rng.choice((BIG, SMALL)))


@dataclass(frozen=True)
class _Single:
    """One shape in one of POSITIONS: what the shape, colour, size and position tasks ask about."""
    shape: Shape
    position: str
    size: str


def _single(rng: random.Random) -> _Single:
    position = rng.choice(sorted(POSITIONS))
    size = rng.choice(("big", "small"))
    shape = _shape_in_cell(rng, *POSITIONS[position], rng.choice(SHAPES), rng.choice(sorted(COLOURS)),
                           BIG if size == "big" else SMALL)
    return _Single(shape, position, size)


def _asking(field: Callable[[_Single], str]) -> Callable[[random.Random], Example]:
    def make(rng: random.Random) -> Example:
        single = _single(rng)
        return Example(((single.shape,),), {"label": field(single)})
    return make


def _count(rng: random.Random) -> Example:
    cells = rng.sample(range(9), rng.randint(1, 4))
    return Example((tuple(_random_shape(rng, *divmod(cell, 3)) for cell in sorted(cells)),),
                   {"answer": str(len(cells))})


def _odd_one_out(rng: random.Random) -> Example:
    """Three shapes of one side in the middle row; one differs from the other two in kind or in colour."""
    kind, colour, side = rng.choice(SHAPES), rng.choice(sorted(COLOURS)), rng.choice((BIG, SMALL))
    odd = rng.randrange(3)
    if rng.random() < 0.5:
        odd_kind, odd_colour = rng.choice([k for k in SHAPES if k != kind]), colour
    else:
        odd_kind, odd_colour = kind, rng.choice([c for c in sorted(COLOURS) if c != colour])
    looks = [(kind, colour)] * 3
    looks[odd] = (odd_kind, odd_colour)
    shapes = tuple(_shape_in_cell(rng, 1, column, *looks[column], side) for column in range(3))
    return Example((shapes,), {"label": ("left", "middle", "right")[odd]})


def _squares(rng: random.Random) -> Example:
    """One or two squares among zero to two circles and triangles, their boxes in reading order."""
    squares, others = rng.randint(1, 2), rng.randint(0, 2)
    kinds = ["square"] * squares + [rng.choice(("circle", "triangle")) for _ in range(others)]
    rng.shuffle(kinds)
    cells = sorted(rng.sample(range(9), len(kinds)))
    shapes = tuple(_shape_in_cell(rng, *divmod(cell, 3), kind, rng.choice(sorted(COLOURS)), rng.choice((BIG, SMALL)))
                   for cell, kind in zip(cells, kinds))
    boxes = [{"label": "square", "box": [coordinate / IMAGE_SIZE for coordinate in shape.box]}
             for shape in shapes if shape.kind == "square"]
    return Example((shapes,), {"boxes": boxes})


def _motion(rng: random.Random) -> Example:
    """A small shape moving MOTION_STEP px a frame in one direction, anywhere it stays inside the picture."""
    direction = rng.choice(sorted(DIRECTIONS))
    dx, dy = DIRECTIONS[direction]
    travel = MOTION_STEP * (MOTION_FRAMES - 1)
    free = IMAGE_SIZE - SMALL
    # Along the motion the start leaves room for the travel; across it, anywhere.
    x = rng.randint(travel if dx < 0 else 0, free - (travel if dx > 0 else 0))
    y = rng.randint(travel if dy < 0 else 0, free - (travel if dy > 0 else 0))
    kind, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
    frames = []
    for step in range(MOTION_FRAMES):
        x0, y0 = x + dx * MOTION_STEP * step, y + dy * MOTION_STEP * step
        frames.append((Shape(kind, colour, (x0, y0, x0 + SMALL, y0 + SMALL)),))
    return Example(tuple(frames), {"label": direction})


def _flipped_position(rng: random.Random) -> Example:
    example = _asking(lambda single: single.position)(rng)
    return Example(example.frames, {"label": FLIPPED[str(example.target["label"])]})


DEMO_TASKS = (
    DemoTask("shape", "classification", SHAPES, "accuracy", 0.9, "What shape is this?", "single-shape",
             _asking(lambda single: single.shape.kind)),
    DemoTask("colour", "classification", tuple(sorted(COLOURS)), "accuracy", 0.9, "What colour is the shape?",
             "single-colour", _asking(lambda single: single.shape.colour)),
    DemoTask("size", "classification", ("big", "small"), "accuracy", 0.9, "Is the shape big or small?",
             "single-size", _asking(lambda single: single.size)),
    DemoTask("position", "classification", tuple(sorted(POSITIONS)), "accuracy", 0.9, "Where is the shape?",
             "single-position", _asking(lambda single: single.position)),
    DemoTask("count", "generation", (), "exact_match", 0.8, "How many shapes are there?", "count", _count),
    DemoTask("odd-one-out", "classification", ("left", "middle", "right"), "accuracy", 0.8,
             "Which shape is the odd one out?", "odd-one-out", _odd_one_out),
    DemoTask("squares", "detection", ("square",), "map50", 0.5, "Find the squares.", "squares", _squares),
    DemoTask("motion", "classification", tuple(sorted(DIRECTIONS)), "accuracy", 0.85, "Which way does it move?",
             "motion", _motion),
    # position's prompt and stream: the same pictures and question, every answer the opposite.
    DemoTask("position-flipped", "classification", tuple(sorted(POSITIONS)), "accuracy", 0.9, "Where is the shape?",
             "single-position", _flipped_position),
)


def draw(shapes: tuple[Shape, ...]) -> Image.Image:
    """One picture: the shapes in their colours on BACKGROUND, without anti-aliasing (pure colours)."""
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    pen = ImageDraw.Draw(image)
    for shape in shapes:
        x0, y0, x1, y1 = shape.box
        fill = COLOURS[shape.colour]
        if shape.kind == "circle":
            pen.ellipse((x0, y0, x1 - 1, y1 - 1), fill=fill)
        elif shape.kind == "square":
            pen.rectangle((x0, y0, x1 - 1, y1 - 1), fill=fill)
        else:
            pen.polygon(((x0, y1 - 1), (x1 - 1, y1 - 1), ((x0 + x1 - 1) / 2, y0)), fill=fill)
    return image


def _write_split(task: DemoTask, split: str, count: int, seed: int, data_dir: Path) -> None:
    # A string seed is hashed deterministically (sha512), unlike hash(); tasks of one stream share pictures.
    rng = random.Random(f"{seed}:{task.stream}:{split}")
    image_dir = data_dir / "img" / task.name
    image_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for index in range(count):
        example = task.make(rng)
        paths = []
        for frame, shapes in enumerate(example.frames):
            suffix = f"-{frame}" if len(example.frames) > 1 else ""
            path = image_dir / f"{split}-{index:04d}{suffix}.png"
            draw(shapes).save(path, format="PNG")
            paths.append(path.relative_to(data_dir).as_posix())
        media = {"video": paths} if len(paths) > 1 else {"images": paths}
        lines.append(json.dumps({"prompt": task.prompt, **media, **example.target}))
    (data_dir / f"{task.name}.{split}.jsonl").write_text("".join(line + "\n" for line in lines))


def manifest(seed: int) -> dict[str, object]:
    """The suite's manifest (docs/fuse.md): generation tasks carry no labels."""
    tasks = []
    for task in DEMO_TASKS:
        entry: dict[str, object] = {"name": task.name, "type": task.type}
        if task.labels:
            entry["labels"] = list(task.labels)
        entry.update(train=f"data/{task.name}.train.jsonl", eval=f"data/{task.name}.eval.jsonl",
                     metric=task.metric, floor=task.floor)
        tasks.append(entry)
    return {"base_model": DEMO_QWEN2VL_BASE_MODEL, "seed": seed, "training": TRAINING, "tasks": tasks}


def _complete(out_dir: Path, manifest_text: str, train_per_task: int, eval_per_task: int) -> bool:
    """A published suite of this seed and these sizes (the manifest is written last, before the rename)."""
    path = out_dir / MANIFEST
    if not path.is_file() or path.read_text() != manifest_text:
        return False
    for task in DEMO_TASKS:
        for split, count in (("train", train_per_task), ("eval", eval_per_task)):
            data = out_dir / "data" / f"{task.name}.{split}.jsonl"
            if not data.is_file() or len(data.read_text().splitlines()) != count:
                return False
    return True


def build_demo_tasks(out_dir: Path, seed: int = 0, train_per_task: int = 64, eval_per_task: int = 32,
                     progress: Callable[[str], None] = print) -> Path:
    """Write the suite into `out_dir` (reusing one already there of this seed and sizes); return the manifest's
    path. Written into a sibling staging directory and renamed, so an interrupted build leaves no suite."""
    assert train_per_task > 0 and eval_per_task > 0, "every task needs train and eval examples"
    manifest_text = yaml.safe_dump(manifest(seed), sort_keys=False)
    if _complete(out_dir, manifest_text, train_per_task, eval_per_task):
        progress(f"demo tasks: present at {out_dir}")
        return out_dir / MANIFEST
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "data").mkdir(parents=True)
    for index, task in enumerate(DEMO_TASKS, start=1):
        _write_split(task, "train", train_per_task, seed, staging / "data")
        _write_split(task, "eval", eval_per_task, seed, staging / "data")
        progress(f"task {index}/{len(DEMO_TASKS)} {task.name} ({task.type}): {train_per_task} train, "
                 f"{eval_per_task} eval")
    (staging / MANIFEST).write_text(manifest_text)
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir / MANIFEST
