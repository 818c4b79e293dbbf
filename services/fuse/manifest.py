"""The task manifest of `tessera fuse` (docs/fuse.md): YAML in, a checked, frozen Manifest out.

The YAML is composed into nodes first (PyYAML's safe loader) and walked by hand, so that every refusal
names the file, the line its value sits on and the field:

    load_manifest("fuse.yaml") -> ManifestError("fuse.yaml:14: tasks[0].floor: 1.5 is not in [0, 1]")
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, NoReturn, cast

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from services.fuse.paths import PathRefused, resolve_inside

TaskType = Literal["generation", "classification", "detection"]
METRIC_OF: dict[str, str] = {"generation": "exact_match", "classification": "accuracy", "detection": "map50"}
# The language model's projections an adapter may target (a worker's default lora_targets).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TASK_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")  # also the name requests route by: "task:shape"
MAX_MANIFEST_BYTES = 1 << 20  # a manifest lists tasks and paths, never data
MAX_TASKS = 256
MAX_LABELS = 1024
MAX_NAME_CHARS = 256  # a base model's or a label's name


class ManifestError(ValueError):
    """A refused manifest; the message starts '<file>:<line>: '."""


@dataclass(frozen=True)
class Training:
    """Every adapter's LoRA and optimizer settings; the defaults are the doc's."""

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    tower: bool = False  # also adapt the vision tower's linears of those names
    epochs: int = 3
    learning_rate: float = 0.001
    batch_size: int = 8


@dataclass(frozen=True)
class Task:
    name: str
    type: TaskType
    labels: tuple[str, ...]  # () for generation
    train: Path  # resolved, a regular file inside the manifest's directory
    eval: Path
    metric: str  # METRIC_OF[type]
    floor: float  # in [0, 1]


@dataclass(frozen=True)
class Manifest:
    path: Path
    base_model: str
    seed: int
    training: Training
    tasks: tuple[Task, ...]


class _Reader:
    """Reads values off composed YAML nodes, failing with the file, the node's line and the field."""

    def __init__(self, path: Path, loader: yaml.SafeLoader) -> None:
        self.path = path
        self.loader = loader

    def fail(self, node: Node, field: str, message: str) -> NoReturn:
        where = f"{field}: " if field else ""
        raise ManifestError(f"{self.path}:{node.start_mark.line + 1}: {where}{message}")

    def mapping(self, node: Node, field: str, required: tuple[str, ...],
                optional: tuple[str, ...] = ()) -> dict[str, Node]:
        """Its values by key; unknown, repeated and missing keys refused."""
        if not isinstance(node, MappingNode):
            self.fail(node, field, "must be a mapping")
        allowed = required + optional
        found: dict[str, Node] = {}
        for key_node, value_node in node.value:
            # The raw scalar, not a constructed one: `<<` merges or `1:` are unknown keys, not tricks.
            key = key_node.value if isinstance(key_node, ScalarNode) else f"<{key_node.tag}>"
            name = f"{field}.{key}" if field else key
            if key not in allowed:
                self.fail(key_node, name, f"unknown key (allowed: {', '.join(allowed)})")
            if key in found:
                self.fail(key_node, name, f"appears twice (first on line {found[key].start_mark.line + 1})")
            found[key] = value_node
        missing = [key for key in required if key not in found]
        if missing:
            self.fail(node, field, f"lacks {', '.join(missing)}")
        return found

    def _scalar(self, node: Node, field: str, kind: str) -> Any:
        if not isinstance(node, ScalarNode):
            self.fail(node, field, f"must be {kind}")
        try:
            return self.loader.construct_object(node, deep=True)
        except yaml.YAMLError as exc:  # a tag the safe loader refuses (!!python/object, ...)
            self.fail(node, field, f"must be {kind} ({exc})")

    def string(self, node: Node, field: str) -> str:
        value = self._scalar(node, field, "a string")
        if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS or "\x00" in value:
            self.fail(node, field, f"must be a non-empty string of at most {MAX_NAME_CHARS} characters")
        return value

    def boolean(self, node: Node, field: str) -> bool:
        value = self._scalar(node, field, "true or false")
        if not isinstance(value, bool):
            self.fail(node, field, f"{value!r} is not true or false")
        return value

    def integer(self, node: Node, field: str, low: int, high: int) -> int:
        value = self._scalar(node, field, "an integer")
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            self.fail(node, field, f"{value!r} is not an integer in [{low}, {high}]")
        return value

    def number(self, node: Node, field: str, within: Callable[[float], bool], interval: str) -> float:
        """`within` decides the range; NaN fails every comparison, so it is refused with the rest."""
        value = self._scalar(node, field, "a number")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # PyYAML follows YAML 1.1: a float needs a dot, so `1e-3` is read as text.
            self.fail(node, field, f"{value!r} is not a number (YAML floats need a dot: 1.0e-3)")
        if not within(value):
            self.fail(node, field, f"{value!r} is not in {interval}")
        return float(value)

    def strings(self, node: Node, field: str, limit: int) -> tuple[str, ...]:
        """A non-empty list of distinct strings."""
        if not isinstance(node, SequenceNode) or not node.value or len(node.value) > limit:
            self.fail(node, field, f"must be a list of 1 to {limit} strings")
        values: list[str] = []
        for i, item in enumerate(node.value):
            value = self.string(item, f"{field}[{i}]")
            if value in values:
                self.fail(item, f"{field}[{i}]", f"{value!r} is listed twice")
            values.append(value)
        return tuple(values)

    def data_path(self, node: Node, field: str) -> Path:
        value = self._scalar(node, field, "a path")
        if not isinstance(value, str):
            self.fail(node, field, f"{value!r} is not a path")
        try:
            return resolve_inside(self.path.resolve().parent, value)
        except PathRefused as exc:
            self.fail(node, field, str(exc))


def _training(r: _Reader, node: Node | None) -> Training:
    if node is None:
        return Training()
    keys = r.mapping(node, "training", (), tuple(f.name for f in fields(Training)))
    settings: dict[str, Any] = {}
    checks: dict[str, Callable[[Node, str], Any]] = {
        "rank": lambda n, f: r.integer(n, f, 1, 256),
        "alpha": lambda n, f: r.number(n, f, lambda v: 0 < v <= 1024, "(0, 1024]"),
        "target_modules": lambda n, f: r.strings(n, f, len(PROJECTIONS)),
        "tower": r.boolean,
        "epochs": lambda n, f: r.integer(n, f, 1, 100),
        "learning_rate": lambda n, f: r.number(n, f, lambda v: 0 < v < 1, "(0, 1)"),
        "batch_size": lambda n, f: r.integer(n, f, 1, 1024),
    }
    for key, value_node in keys.items():
        settings[key] = checks[key](value_node, f"training.{key}")
    for i, module in enumerate(settings.get("target_modules", ())):
        if module not in PROJECTIONS:
            r.fail(keys["target_modules"].value[i], f"training.target_modules[{i}]",
                   f"{module!r} is not one of the language model's projections ({', '.join(PROJECTIONS)})")
    return Training(**settings)


def _task(r: _Reader, node: Node, field: str) -> Task:
    keys = r.mapping(node, field, ("name", "type", "train", "eval", "metric", "floor"), ("labels",))
    name = r.string(keys["name"], f"{field}.name")
    if not TASK_NAME.fullmatch(name):
        r.fail(keys["name"], f"{field}.name", f"{name!r} does not match {TASK_NAME.pattern}")
    task_type = r.string(keys["type"], f"{field}.type")
    if task_type not in METRIC_OF:
        r.fail(keys["type"], f"{field}.type", f"{task_type!r} is not one of {', '.join(METRIC_OF)}")
    metric = r.string(keys["metric"], f"{field}.metric")
    if metric != METRIC_OF[task_type]:
        r.fail(keys["metric"], f"{field}.metric",
               f"a {task_type} task is measured by {METRIC_OF[task_type]}, not {metric!r}")
    labels: tuple[str, ...] = ()
    if task_type == "generation":
        if "labels" in keys:
            r.fail(keys["labels"], f"{field}.labels", "a generation task has no labels")
    elif "labels" not in keys:
        r.fail(node, f"{field}.labels", f"a {task_type} task needs labels")
    else:
        labels = r.strings(keys["labels"], f"{field}.labels", MAX_LABELS)
    return Task(name=name, type=cast(TaskType, task_type), labels=labels,
                train=r.data_path(keys["train"], f"{field}.train"),
                eval=r.data_path(keys["eval"], f"{field}.eval"), metric=metric,
                floor=r.number(keys["floor"], f"{field}.floor", lambda v: 0 <= v <= 1, "[0, 1]"))


def _manifest(r: _Reader, root: Node) -> Manifest:
    keys = r.mapping(root, "", ("base_model", "tasks"), ("seed", "training"))
    base_model = r.string(keys["base_model"], "base_model")
    seed = r.integer(keys["seed"], "seed", 0, 2**32 - 1) if "seed" in keys else 0
    training = _training(r, keys.get("training"))
    tasks_node = keys["tasks"]
    if not isinstance(tasks_node, SequenceNode) or not tasks_node.value or len(tasks_node.value) > MAX_TASKS:
        r.fail(tasks_node, "tasks", f"must be a list of 1 to {MAX_TASKS} tasks")
    tasks: list[Task] = []
    first_line: dict[str, int] = {}
    for i, task_node in enumerate(tasks_node.value):
        task = _task(r, task_node, f"tasks[{i}]")
        if task.name in first_line:
            r.fail(task_node, f"tasks[{i}].name",
                   f"task {task.name!r} is named twice (first on line {first_line[task.name]})")
        first_line[task.name] = task_node.start_mark.line + 1
        tasks.append(task)
    return Manifest(path=r.path, base_model=base_model, seed=seed, training=training,
                    tasks=tuple(tasks))


def _compose(path: Path, text: str) -> tuple[yaml.SafeLoader, Node]:
    """The loader (it constructs the scalars later) and the one document's root node."""
    try:
        loader = yaml.SafeLoader(text)
    except yaml.reader.ReaderError as exc:  # a control character, found before any parsing
        line = text.count("\n", 0, exc.position) + 1
        raise ManifestError(f"{path}:{line}: is not valid YAML: {exc.reason}") from None
    try:
        root = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        loader.dispose()
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        why = " ".join(part for part in (exc.context, exc.problem) if part)
        raise ManifestError(f"{path}:{line}: is not valid YAML: {why}") from None
    if root is None:
        loader.dispose()
        raise ManifestError(f"{path}:1: is empty")
    return loader, root


def load_manifest(path: str | Path) -> Manifest:
    """The manifest at `path`, every field checked; ManifestError ('<file>:<line>: ...') on the first refusal."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise ManifestError(f"{path}:1: cannot be read ({exc.strerror})") from exc
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path}:1: is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ManifestError(f"{path}:{line}: is not UTF-8 text") from None
    loader, root = _compose(path, text)
    try:
        return _manifest(_Reader(path, loader), root)
    finally:
        loader.dispose()
