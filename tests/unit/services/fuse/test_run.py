"""`tessera fuse` end to end on the tiny suite: the report holds the fusion and both baselines, a rerun replays
the journals without training, an interrupted run continues, and bad manifests are refused with file:line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.cli import main
from services.demo_assets import DEMO_QWEN2VL_BASE_MODEL
from services.fuse.trainer import PeftTrainer

from .conftest import SMALL_TASKS, FuseSuite


@pytest.fixture
def home(fuse_suite: FuseSuite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A TESSERA_HOME whose models directory holds the tiny base (not registered: the CLI falls back to it)."""
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "models").mkdir(parents=True)
    (tmp_path / "home" / "models" / DEMO_QWEN2VL_BASE_MODEL).symlink_to(fuse_suite.base_dir)
    return tmp_path / "home"


@pytest.fixture
def train_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    train = PeftTrainer.train

    def counted(self: PeftTrainer, state: str, task: str) -> str:
        calls.append(task)
        return train(self, state, task)
    monkeypatch.setattr(PeftTrainer, "train", counted)
    return calls


def test_fuse_writes_the_report_and_a_rerun_trains_nothing(fuse_suite: FuseSuite, home: Path, tmp_path: Path,
                                                           train_calls: list[str]) -> None:
    run_dir = tmp_path / "run"
    assert main(["fuse", str(fuse_suite.manifest), "--run-dir", str(run_dir)]) == 0
    report = json.loads((run_dir / "report.json").read_text())
    assert list(report["tasks"]) == list(SMALL_TASKS)
    for strategy in ("fused", "one_per_task", "all_in_one"):
        held = [task for adapter in report[strategy]["adapters"] for task in adapter["tasks"]]
        assert sorted(held) == sorted(SMALL_TASKS), strategy
        assert report["wall_time_s"][strategy] >= 0
        for adapter in report[strategy]["adapters"]:
            assert set(adapter["accuracy"]) == set(adapter["tasks"])
            assert (run_dir / adapter["state"] / "adapter_model.safetensors").is_file()
    assert len(report["one_per_task"]["adapters"]) == 3 and len(report["all_in_one"]["adapters"]) == 1
    markdown = (run_dir / "report.md").read_text()
    assert "one adapter per task" in markdown and "one adapter for all tasks" in markdown
    first_calls = len(train_calls)
    assert first_calls >= 3 + 3  # fused: each task at least once; one per task: 3; all in one: 3
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())

    assert main(["fuse", str(fuse_suite.manifest), "--run-dir", str(run_dir)]) == 0
    assert len(train_calls) == first_calls  # every decision replayed from the journals
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == checkpoints
    rerun = json.loads((run_dir / "report.json").read_text())
    assert {k: rerun[k] for k in ("fused", "one_per_task", "all_in_one")} == \
        {k: report[k] for k in ("fused", "one_per_task", "all_in_one")}


def test_an_interrupted_run_continues_where_its_journal_ends(fuse_suite: FuseSuite, home: Path, tmp_path: Path,
                                                             train_calls: list[str]) -> None:
    run_dir = tmp_path / "run"
    assert main(["fuse", str(fuse_suite.manifest), "--run-dir", str(run_dir)]) == 0
    journal = run_dir / "all_in_one.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    assert [json.loads(line)["kind"] for line in lines] == ["started", "trained", "trained", "trained", "kept"]
    journal.write_text("".join(lines[:2]) + lines[2][:10])  # killed while writing the second training's record
    (run_dir / "report.json").unlink()
    train_calls.clear()
    assert main(["fuse", str(fuse_suite.manifest), "--run-dir", str(run_dir)]) == 0
    assert train_calls == ["count", "squares"]
    assert len(journal.read_text().splitlines()) == 5


def test_fuse_refuses_a_bad_manifest_naming_file_and_line(fuse_suite: FuseSuite, home: Path, tmp_path: Path,
                                                          capsys) -> None:
    bad = fuse_suite.manifest.with_name("bad.yaml")
    text = fuse_suite.manifest.read_text()
    bad.write_text(text.replace("floor: 0.9", "floor: 1.5", 1))
    line = text[:text.index("floor: 0.9")].count("\n") + 1
    assert main(["fuse", str(bad), "--run-dir", str(tmp_path / "run")]) == 2
    assert f"{bad}:{line}: tasks[0].floor: 1.5 is not in [0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_fuse_refuses_a_bad_data_line(fuse_suite: FuseSuite, home: Path, tmp_path: Path, capsys) -> None:
    suite = tmp_path / "suite"
    shutil.copytree(fuse_suite.manifest.parent, suite, symlinks=True)
    data = suite / "data" / "count.eval.jsonl"
    data.write_text(data.read_text() + '{"prompt": "How many?", "label": "3"}\n')
    assert main(["fuse", str(suite / "small.yaml"), "--run-dir", str(tmp_path / "run")]) == 2
    assert f"{data}:5: unknown fields 'label'" in capsys.readouterr().err


def test_register_imports_each_fused_adapter(fuse_suite: FuseSuite, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from registry.store import RegistryStore
    from services.common.config import load_config

    home = tmp_path / "home"
    monkeypatch.setenv("TESSERA_HOME", str(home))
    base = shutil.copytree(fuse_suite.base_dir, home / "models" / DEMO_QWEN2VL_BASE_MODEL)
    config = load_config(None)
    store = RegistryStore.from_config(config)
    store.register_base_model(DEMO_QWEN2VL_BASE_MODEL, str(base))
    run_dir = tmp_path / "run"
    for _ in range(2):  # the same content again is left alone
        assert main(["fuse", str(fuse_suite.manifest), "--run-dir", str(run_dir), "--register"]) == 0
    report = json.loads((run_dir / "report.json").read_text())
    assert [entry["name"] for entry in report["registered"]] == \
        [f"small-fused-{i}" for i in range(len(report["fused"]["adapters"]))]
    for entry, adapter in zip(report["registered"], report["fused"]["adapters"]):
        assert entry["tasks"] == adapter["tasks"]
        record = store.get_adapter(entry["name"])
        assert record.sha256 == adapter["sha256"]
        # The registry knows which tasks it serves, as measured: requests may name them ("task:<name>").
        assert [(t.name, t.accuracy, t.metric) for t in record.tasks] == \
            [(task, adapter["accuracy"][task], report["tasks"][task]["metric"]) for task in adapter["tasks"]]
    store.close()
