"""The task manifest of `tessera fuse` (docs/fuse.md): the doc's example parses, and every refusal names
the file, the YAML line and the field."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.fuse.manifest import Manifest, ManifestError, Task, Training, load_manifest

MANIFEST = """\
base_model: tessera-demo-qwen2vl
seed: 0
training:
  rank: 8
  alpha: 16
  target_modules: [q_proj, v_proj]
  tower: false
  epochs: 3
  learning_rate: 0.001
  batch_size: 8
tasks:
  - name: shape
    type: classification
    labels: [circle, square, triangle]
    train: data/shape.train.jsonl
    eval: data/shape.eval.jsonl
    metric: accuracy
    floor: 0.9
  - name: count
    type: generation
    train: data/count.jsonl
    eval: data/count.jsonl
    metric: exact_match
    floor: 0.5
"""


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    for name in ("shape.train.jsonl", "shape.eval.jsonl", "count.jsonl"):
        (tmp_path / "data" / name).write_text("{}\n")
    return tmp_path


def _write(home: Path, text: str) -> Path:
    path = home / "fuse.yaml"
    path.write_text(text)
    return path


def test_the_docs_manifest_parses_to_its_tasks(home):
    path = _write(home, MANIFEST)
    data = home.resolve() / "data"
    assert load_manifest(path) == Manifest(
        path=path, base_model="tessera-demo-qwen2vl", seed=0,
        training=Training(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"), tower=False, epochs=3,
                          learning_rate=0.001, batch_size=8),
        tasks=(Task(name="shape", type="classification", labels=("circle", "square", "triangle"),
                    train=data / "shape.train.jsonl", eval=data / "shape.eval.jsonl", metric="accuracy", floor=0.9),
               Task(name="count", type="generation", labels=(), train=data / "count.jsonl",
                    eval=data / "count.jsonl", metric="exact_match", floor=0.5)))


def test_seed_and_training_default_as_the_doc_shows(home):
    text = MANIFEST.replace("seed: 0\n", "").split("training:")[0] + "tasks:" + MANIFEST.split("tasks:")[1]
    manifest = load_manifest(_write(home, text))
    assert (manifest.seed, manifest.training) == (0, Training())
    assert Training() == Training(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"), tower=False, epochs=3,
                                  learning_rate=0.001, batch_size=8)


# (old text, new text, the line the error names, what the message says after "fuse.yaml:<line>: ")
REFUSALS = [
    ("seed: 0", "seed: 0\nmodel: x", 3, "model: unknown key"),
    ("  rank: 8", "  rank: 8\n  dropout: 0.1", 5, "training.dropout: unknown key"),
    ("    floor: 0.9", "    floor: 0.9\n    weight: 2", 19, "tasks[0].weight: unknown key"),
    ("seed: 0", "seed: 0\nseed: 1", 3, "seed: appears twice (first on line 2)"),
    ("base_model: tessera-demo-qwen2vl\n", "", 1, ": lacks base_model"),
    ("    floor: 0.5", "", 19, "tasks[1]: lacks floor"),
    ("name: count", "name: shape", 19, "tasks[1].name: task 'shape' is named twice (first on line 12)"),
    ("name: shape", "name: Shape", 12, "tasks[0].name: 'Shape' does not match"),
    ("name: shape", "name: -shape", 12, "tasks[0].name: '-shape' does not match"),
    ("name: shape", f"name: {'s' * 64}", 12, "tasks[0].name:"),
    ("type: classification", "type: regression", 13, "tasks[0].type: 'regression' is not one of"),
    ("metric: accuracy", "metric: map50", 17, "tasks[0].metric: a classification task is measured by accuracy"),
    ("metric: exact_match", "metric: accuracy", 23, "tasks[1].metric: a generation task is measured by"),
    ("    labels: [circle, square, triangle]\n", "", 12, "tasks[0].labels: a classification task needs labels"),
    ("labels: [circle, square, triangle]", "labels: [circle, square, circle]", 14,
     "tasks[0].labels[2]: 'circle' is listed twice"),
    ("labels: [circle, square, triangle]", "labels: []", 14, "tasks[0].labels: must be a list of 1 to"),
    ("    type: generation", "    type: generation\n    labels: [a]", 21, "tasks[1].labels: a generation task has no"),
    ("floor: 0.9", "floor: 1.5", 18, "tasks[0].floor: 1.5 is not in [0, 1]"),
    ("floor: 0.9", "floor: -0.1", 18, "tasks[0].floor: -0.1 is not in [0, 1]"),
    ("floor: 0.9", "floor: .nan", 18, "tasks[0].floor: nan is not in [0, 1]"),
    ("floor: 0.9", "floor: high", 18, "tasks[0].floor: 'high' is not a number"),
    ("rank: 8", "rank: 0", 4, "training.rank: 0 is not an integer in [1, 256]"),
    ("rank: 8", "rank: 257", 4, "training.rank: 257 is not an integer in [1, 256]"),
    ("rank: 8", "rank: 8.5", 4, "training.rank: 8.5 is not an integer"),
    ("rank: 8", "rank: true", 4, "training.rank: True is not an integer"),
    ("epochs: 3", "epochs: 101", 8, "training.epochs: 101 is not an integer in [1, 100]"),
    ("learning_rate: 0.001", "learning_rate: 0", 9, "training.learning_rate: 0 is not in (0, 1)"),
    ("learning_rate: 0.001", "learning_rate: 1.0", 9, "training.learning_rate: 1.0 is not in (0, 1)"),
    ("learning_rate: 0.001", "learning_rate: 1e-3", 9, "YAML floats need a dot"),
    ("batch_size: 8", "batch_size: 1025", 10, "training.batch_size: 1025 is not an integer in [1, 1024]"),
    ("alpha: 16", "alpha: -1.0", 5, "training.alpha: -1.0 is not in (0, 1024]"),
    ("tower: false", "tower: 2", 7, "training.tower: 2 is not true or false"),
    ("[q_proj, v_proj]", "[q_proj, qkv]", 6, "training.target_modules[1]: 'qkv' is not one of the language"),
    ("[q_proj, v_proj]", "[q_proj, q_proj]", 6, "training.target_modules[1]: 'q_proj' is listed twice"),
    ("seed: 0", "seed: -1", 2, "seed: -1 is not an integer"),
    ("seed: 0", "seed: !!python/object:os.system x", 2, "seed: must be an integer"),
    ("base_model: tessera-demo-qwen2vl", "base_model: [a]", 1, "base_model: must be a string"),
    (MANIFEST[MANIFEST.index("  - name: count"):], "  - count\n", 19, "tasks[1]: must be a mapping"),
    (MANIFEST[MANIFEST.index("tasks:"):], "tasks: []\n", 11, "tasks: must be a list of 1 to"),
    ("train: data/shape.train.jsonl", "train: data/missing.jsonl", 15, "tasks[0].train: path 'data/missing.jsonl'"
     " does not exist"),
    ("train: data/shape.train.jsonl", "train: /etc/passwd", 15, "tasks[0].train: path '/etc/passwd' is absolute"),
    ("train: data/shape.train.jsonl", "train: ../fuse/data/shape.train.jsonl", 15, "tasks[0].train: path "
     "'../fuse/data/shape.train.jsonl' holds '..'"),
    ("eval: data/shape.eval.jsonl", "eval: data", 16, "tasks[0].eval: path 'data' is not a regular file"),
    ("eval: data/shape.eval.jsonl", "eval: 3", 16, "tasks[0].eval: 3 is not a path"),
    ("seed: 0", "seed: [0", 3, "is not valid YAML"),
    ("seed: 0", "seed: 0\n---\nseed: 1", 3,
     "is not valid YAML: expected a single document in the stream but found another document"),
]


@pytest.mark.parametrize("old, new, line, message", REFUSALS, ids=[r[1][:40] for r in REFUSALS])
def test_each_refusal_names_the_file_line_and_field(home, old, new, line, message):
    assert old in MANIFEST
    path = _write(home, MANIFEST.replace(old, new, 1))
    with pytest.raises(ManifestError) as caught:
        load_manifest(path)
    assert str(caught.value).startswith(f"{path}:{line}: "), str(caught.value)
    assert message in str(caught.value)


def test_a_symbolic_link_out_of_the_manifests_directory_is_refused(home, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside") / "secret.jsonl"
    outside.write_text("{}\n")
    (home / "data" / "link.jsonl").symlink_to(outside)
    path = _write(home, MANIFEST.replace("data/count.jsonl", "data/link.jsonl"))
    with pytest.raises(ManifestError, match=r"fuse.yaml:21: tasks\[1\].train: path 'data/link.jsonl' leaves"):
        load_manifest(path)


def test_a_symbolic_link_that_stays_inside_is_followed(home):
    os.symlink("count.jsonl", home / "data" / "alias.jsonl")
    manifest = load_manifest(_write(home, MANIFEST.replace("eval: data/count.jsonl", "eval: data/alias.jsonl")))
    assert manifest.tasks[1].eval == home.resolve() / "data" / "count.jsonl"


@pytest.mark.parametrize("text, line, message", [
    ("", 1, "is empty"),
    ("- a\n- b\n", 1, "must be a mapping"),
    ("seed: 0\n\x07\n", 2, "is not valid YAML"),
])
def test_files_that_are_not_a_manifest_are_refused(home, text, line, message):
    path = _write(home, text)
    with pytest.raises(ManifestError, match=f"^{path}:{line}: .*{message}"):
        load_manifest(path)


def test_a_manifest_that_is_not_utf8_or_too_large_is_refused(home):
    path = home / "fuse.yaml"
    path.write_bytes(b"seed: 0\nbase_model: \xff\n")
    with pytest.raises(ManifestError, match=f"^{path}:2: is not UTF-8"):
        load_manifest(path)
    path.write_bytes(b"#" * (2 << 20))
    with pytest.raises(ManifestError, match=f"^{path}:1: is larger than"):
        load_manifest(path)
