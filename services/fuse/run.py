"""One `tessera fuse` run: VaLoRA's greedy fusion and its two baselines over a manifest's tasks, in a run
directory that makes it resumable, then report.json and report.md there.

    RUN_DIR/
      checkpoints/0000 ...          every state (PEFT checkpoint directories; services/fuse/trainer.py)
      fused.jsonl                   each strategy's journal (policy/fusion.py), one decision a line, written
      one_per_task.jsonl            the moment it is made: a rerun replays them and trains nothing twice
      all_in_one.jsonl
      report.json  report.md
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policy.fusion import Decision, FusionResult, Record, Trainer, all_in_one, fuse, one_per_task
from services.common.adapter_layout import directory_digest
from services.fuse.manifest import Manifest

if TYPE_CHECKING:
    from registry.store import RegistryStore

STRATEGIES: dict[str, Callable[..., FusionResult[str]]] = {
    "fused": fuse, "one_per_task": one_per_task, "all_in_one": all_in_one}


class Journal(list[Record]):
    """A fusion journal persisted as JSON lines: each record appended is written and synced at once."""

    def __init__(self, path: Path, progress: Callable[[str], None]) -> None:
        self.path = path
        self.progress = progress
        records = []
        if path.exists():
            text = path.read_text()
            # A last line without its newline was cut off mid-write: that decision was never made.
            complete = text[:text.rfind("\n") + 1]
            records = [json.loads(line) for line in complete.splitlines()]
            if len(complete) != len(text):
                path.write_text(complete)
        super().__init__(records)

    def append(self, record: Record) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        super().append(record)
        self.progress(f"  {Decision.from_record(record, len(self))}{_accuracies(record)}")


def _accuracies(record: Record) -> str:
    accuracy = record.get("accuracy") or {}
    return (": " + ", ".join(f"{task} {value:.3f}" for task, value in accuracy.items())) if accuracy else ""


def _result(result: FusionResult[str], run_dir: Path) -> dict[str, Any]:
    return {"adapters": [{"tasks": list(a.tasks), "state": a.state, "accuracy": dict(a.accuracy),
                          "misses": list(a.misses), "sha256": directory_digest(run_dir / a.state)}
                         for a in result.adapters],
            "misses": list(result.misses)}


def run_fuse(manifest: Manifest, trainer: Trainer[str], run_dir: Path,
             progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs (or continues) the fusion and both baselines; writes and returns the report."""
    tasks = [task.name for task in manifest.tasks]
    floors = {task.name: task.floor for task in manifest.tasks}
    report: dict[str, Any] = {
        "manifest": str(manifest.path), "base_model": manifest.base_model, "seed": manifest.seed,
        "tasks": {t.name: {"type": t.type, "metric": t.metric, "floor": t.floor} for t in manifest.tasks},
        "wall_time_s": {}}
    started = time.monotonic()
    for name, strategy in STRATEGIES.items():
        progress(f"{name}: {len(tasks)} tasks")
        began = time.monotonic()
        journal = Journal(run_dir / f"{name}.jsonl", progress)
        report[name] = _result(strategy(tasks, floors, trainer, journal), run_dir)
        report["wall_time_s"][name] = round(time.monotonic() - began, 3)
        progress(f"{name}: {len(report[name]['adapters'])} adapters, misses: {report[name]['misses'] or 'none'}")
    report["wall_time_s"]["total"] = round(time.monotonic() - started, 3)
    write_report(report, run_dir)
    return report


def _table(result: dict[str, Any], floors: dict[str, float]) -> Iterable[str]:
    yield "| adapter | task | accuracy | floor | met |"
    yield "|---|---|---|---|---|"
    for index, adapter in enumerate(result["adapters"]):
        for task in adapter["tasks"]:
            accuracy = adapter["accuracy"][task]
            yield f"| {index} | {task} | {accuracy:.3f} | {floors[task]:.2f} | {'no' if task in adapter['misses'] else 'yes'} |"


def write_report(report: dict[str, Any], run_dir: Path) -> None:
    (run_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    floors = {name: task["floor"] for name, task in report["tasks"].items()}
    lines = [f"# tessera fuse: {report['manifest']}", "",
             f"Base model {report['base_model']}, seed {report['seed']}, {len(floors)} tasks.", ""]
    titles = {"fused": "Greedy fusion with rollback (VaLoRA §4.2.1)", "one_per_task": "Baseline: one adapter per task",
              "all_in_one": "Baseline: one adapter for all tasks"}
    for name, title in titles.items():
        result = report[name]
        lines += [f"## {title}", "", f"{len(result['adapters'])} adapters; under their floors: "
                  f"{', '.join(result['misses']) or 'none'}; wall time {report['wall_time_s'][name]:.1f} s "
                  "(this invocation's).", "", *_table(result, floors), ""]
    for entry in report.get("registered", []):
        lines.append(f"- registered {entry['name']}: {', '.join(entry['tasks'])} (sha256 {entry['sha256'][:12]})")
    (run_dir / "report.md").write_text("\n".join(lines).rstrip() + "\n")


class FusedRegistrationError(RuntimeError):
    """A fused adapter's name is taken by different content."""


def register_fused(store: RegistryStore, report: dict[str, Any], run_dir: Path, import_root: Path, stem: str,
                   progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Registers each fused adapter as `<stem>-fused-<i>`, copied from the run directory under `import_root`
    (the registry imports only from there), with the tasks it serves and their measured accuracy (requests may
    then name a task: "task:<name>"); the same content again is left alone. Records them in the report."""
    from registry.records import AdapterTask
    from services.common.errors import NotFound

    registered = []
    for index, adapter in enumerate(report["fused"]["adapters"]):
        name = f"{stem}-fused-{index}"
        source = import_root / "fused" / name
        if not source.exists() or directory_digest(source) != adapter["sha256"]:
            shutil.rmtree(source, ignore_errors=True)
            shutil.copytree(run_dir / adapter["state"], source)
        try:
            existing = store.get_adapter(name)
            if existing.sha256 != adapter["sha256"]:
                raise FusedRegistrationError(
                    f"adapter {name} is already registered with sha256 {existing.sha256[:12]}, this run's has "
                    f"{adapter['sha256'][:12]}; delete it through the admin API first")
            progress(f"adapter {name}: already registered")
        except NotFound:
            tasks = [AdapterTask(task, adapter["accuracy"][task], report["tasks"][task]["metric"])
                     for task in adapter["tasks"]]
            store.register_adapter(name, report["base_model"], str(source), tasks=tasks)
            progress(f"adapter {name}: registered, serving {', '.join(adapter['tasks'])}")
        registered.append({"name": name, "tasks": adapter["tasks"], "accuracy": adapter["accuracy"],
                           "sha256": adapter["sha256"]})
    report["registered"] = registered
    write_report(report, run_dir)
    return registered
