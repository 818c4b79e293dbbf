"""The demo task suite: docs/fuse.md's format, deterministic bytes, and answers the pictures bear out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from PIL import Image

from services.cli import main
from services.demo_tasks import (BACKGROUND, BIG, CELL, COLOURS, FLIPPED, IMAGE_SIZE, MOTION_FRAMES, SMALL,
                                 build_demo_tasks)

TARGETS = {"generation": "answer", "classification": "label", "detection": "boxes"}
METRICS = {"generation": "exact_match", "classification": "accuracy", "detection": "map50"}


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_tasks(tmp_path_factory.mktemp("suite") / "tasks", seed=3, train_per_task=6, eval_per_task=4,
                            progress=lambda _: None)


def _records(manifest_path: Path, task: str, split: str = "train") -> list[dict]:
    path = manifest_path.parent / "data" / f"{task}.{split}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _pixels(manifest_path: Path, relative: str) -> Image.Image:
    return Image.open(manifest_path.parent / "data" / relative).convert("RGB")


def _foreground(image: Image.Image) -> list[tuple[int, int, tuple[int, int, int]]]:
    return [(x, y, image.getpixel((x, y))) for y in range(IMAGE_SIZE) for x in range(IMAGE_SIZE)
            if image.getpixel((x, y)) != BACKGROUND]


def _centre(image: Image.Image) -> tuple[float, float]:
    points = _foreground(image)
    return sum(x for x, _, _ in points) / len(points), sum(y for _, y, _ in points) / len(points)


def test_the_manifest_has_docs_fuse_md_fields_and_at_least_eight_tasks(suite: Path) -> None:
    manifest = yaml.safe_load(suite.read_text())
    assert manifest["base_model"] == "tessera-demo-qwen2vl" and manifest["seed"] == 3
    assert set(manifest["training"]) == {"rank", "alpha", "target_modules", "tower", "epochs", "learning_rate",
                                         "batch_size"}
    assert len({task["name"] for task in manifest["tasks"]}) == len(manifest["tasks"]) >= 8
    for task in manifest["tasks"]:
        assert task["metric"] == METRICS[task["type"]] and 0 <= task["floor"] <= 1
        assert ("labels" in task) == (task["type"] != "generation")
        assert task["train"] == f"data/{task['name']}.train.jsonl" and task["eval"] == f"data/{task['name']}.eval.jsonl"


def test_every_record_has_its_type_s_target_and_valid_pngs(suite: Path) -> None:
    for task in yaml.safe_load(suite.read_text())["tasks"]:
        for split, count in (("train", 6), ("eval", 4)):
            records = _records(suite, task["name"], split)
            assert len(records) == count
            for record in records:
                media = record.get("images", record.get("video"))
                assert isinstance(record["prompt"], str) and media
                assert set(record) == {"prompt", "images" if "images" in record else "video", TARGETS[task["type"]]}
                for relative in media:
                    assert not relative.startswith("/") and ".." not in relative
                    with Image.open(suite.parent / "data" / relative) as image:
                        assert image.format == "PNG" and image.size == (IMAGE_SIZE, IMAGE_SIZE)
                if task["type"] == "classification":
                    assert record["label"] in task["labels"]
                elif task["type"] == "generation":
                    assert isinstance(record["answer"], str) and record["answer"].strip()
                else:
                    for box in record["boxes"]:
                        x1, y1, x2, y2 = box["box"]
                        assert box["label"] in task["labels"]
                        assert 0 <= x1 <= x2 <= 1 and 0 <= y1 <= y2 <= 1


def test_the_same_seed_writes_the_same_bytes_and_another_seed_does_not(tmp_path: Path) -> None:
    def tree(seed: int, name: str) -> dict[str, bytes]:
        root = build_demo_tasks(tmp_path / name, seed=seed, train_per_task=3, eval_per_task=2,
                                progress=lambda _: None).parent
        return {path.relative_to(root).as_posix(): path.read_bytes() for path in root.rglob("*") if path.is_file()}

    first = tree(0, "a")
    assert first == tree(0, "b")
    assert first != tree(1, "c")


def test_a_complete_suite_is_reused_and_other_sizes_rebuild_it(tmp_path: Path) -> None:
    lines: list[str] = []
    out_dir = tmp_path / "tasks"
    build_demo_tasks(out_dir, train_per_task=2, eval_per_task=1, progress=lines.append)
    marker = out_dir / "data" / "shape.train.jsonl"
    stamp = marker.stat().st_mtime_ns
    build_demo_tasks(out_dir, train_per_task=2, eval_per_task=1, progress=lines.append)
    assert lines[-1].startswith("demo tasks: present") and marker.stat().st_mtime_ns == stamp
    build_demo_tasks(out_dir, train_per_task=3, eval_per_task=1, progress=lines.append)
    assert len(marker.read_text().splitlines()) == 3
    assert not out_dir.with_name("tasks.partial").exists()


def test_position_answers_where_the_pixels_are_and_flipped_the_opposite(suite: Path) -> None:
    flipped = _records(suite, "position-flipped")
    for record, other in zip(_records(suite, "position"), flipped, strict=True):
        x, y = _centre(_pixels(suite, record["images"][0]))
        expected = ("left" if x < CELL else "right" if x >= 2 * CELL else "top" if y < CELL else "bottom")
        assert record["label"] == expected
        assert other["label"] == FLIPPED[expected]
        assert _pixels(suite, other["images"][0]).tobytes() == _pixels(suite, record["images"][0]).tobytes()


def test_colour_shape_and_size_answers_match_the_pixels(suite: Path) -> None:
    for record in _records(suite, "colour"):
        assert {colour for _, _, colour in _foreground(_pixels(suite, record["images"][0]))} == \
            {COLOURS[record["label"]]}
    for record in _records(suite, "size"):
        points = _foreground(_pixels(suite, record["images"][0]))
        side = max(x for x, _, _ in points) - min(x for x, _, _ in points) + 1
        assert (side > CELL // 2) == (record["label"] == "big")
    for record in _records(suite, "shape"):
        points = _foreground(_pixels(suite, record["images"][0]))
        width = max(x for x, _, _ in points) - min(x for x, _, _ in points) + 1
        height = max(y for _, y, _ in points) - min(y for _, y, _ in points) + 1
        fill = len(points) / (width * height)  # square 1, circle about pi/4, triangle about 1/2
        assert record["label"] == ("square" if fill > 0.95 else "circle" if fill > 0.68 else "triangle")


def test_count_is_the_number_of_occupied_cells(suite: Path) -> None:
    for record in _records(suite, "count") + _records(suite, "count", "eval"):
        points = _foreground(_pixels(suite, record["images"][0]))
        assert record["answer"] == str(len({(x // CELL, y // CELL) for x, y, _ in points}))


def test_odd_one_out_names_the_cell_unlike_the_other_two(suite: Path) -> None:
    for record in _records(suite, "odd-one-out"):
        image = _pixels(suite, record["images"][0])
        # Each cell's picture, its shape aligned to the top-left corner of its own bounding box.
        looks = []
        for column in range(3):
            points = [(x, y, colour) for x, y, colour in _foreground(image) if x // CELL == column]
            left, top = min(x for x, _, _ in points), min(y for _, y, _ in points)
            looks.append(frozenset((x - left, y - top, colour) for x, y, colour in points))
        odd = [index for index in range(3) if looks[index] != looks[(index + 1) % 3]
               and looks[index] != looks[(index + 2) % 3]]
        assert [("left", "middle", "right")[index] for index in odd] == [record["label"]]


def test_square_boxes_cover_exactly_the_solid_squares(suite: Path) -> None:
    for record in _records(suite, "squares"):
        image = _pixels(suite, record["images"][0])
        assert 1 <= len(record["boxes"]) <= 2
        for box in record["boxes"]:
            x1, y1, x2, y2 = (round(fraction * IMAGE_SIZE) for fraction in box["box"])
            inside = {image.getpixel((x, y)) for x in range(x1, x2) for y in range(y1, y2)}
            assert len(inside) == 1 and inside != {BACKGROUND} and x2 - x1 == y2 - y1 in (BIG, SMALL)


def test_motion_label_is_the_way_the_shape_moves_over_four_frames(suite: Path) -> None:
    for record in _records(suite, "motion") + _records(suite, "motion", "eval"):
        assert len(record["video"]) == MOTION_FRAMES
        (x0, y0), (x3, y3) = (_centre(_pixels(suite, record["video"][i])) for i in (0, -1))
        dx, dy = x3 - x0, y3 - y0
        expected = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
        assert record["label"] == expected


def test_cli_demo_tasks_writes_under_out_and_prints_the_manifest(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "home"))
    out_dir = tmp_path / "suite"
    assert main(["demo-tasks", "--out", str(out_dir), "--train", "2", "--eval", "1", "--seed", "5"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"manifest: {out_dir / 'manifest.yaml'}")
    assert yaml.safe_load((out_dir / "manifest.yaml").read_text())["seed"] == 5
    assert len(_records(out_dir / "manifest.yaml", "motion")) == 2


def test_cli_demo_tasks_defaults_to_the_tessera_home(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    assert main(["demo-tasks", "--train", "1", "--eval", "1"]) == 0
    assert (tmp_path / "tasks" / "manifest.yaml").is_file()
