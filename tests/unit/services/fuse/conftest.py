"""A tiny Qwen2-VL and a three-task suite (classification, generation, detection) from `tessera demo-tasks`,
built once per session: small enough that a whole `tessera fuse` run takes seconds on a CPU."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from services.demo_assets import DEMO_QWEN2VL_BASE_MODEL, build_llama, build_qwen2vl
from services.demo_tasks import build_demo_tasks
from tests.unit.gpu_worker.conftest import TINY_LLAMA, TINY_QWEN2VL

SMALL_TASKS = ("shape", "count", "squares")
# A learning rate large enough that one short epoch moves the loss visibly.
SMALL_TRAINING = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "tower": False, "epochs": 1,
                  "learning_rate": 0.01, "batch_size": 4}


@dataclass(frozen=True)
class FuseSuite:
    base_dir: Path
    manifest: Path


@pytest.fixture(scope="session")
def fuse_suite(tmp_path_factory: pytest.TempPathFactory) -> FuseSuite:
    root = tmp_path_factory.mktemp("fuse")
    llama = build_llama(root / "llama", shape=TINY_LLAMA)
    base = build_qwen2vl(root / DEMO_QWEN2VL_BASE_MODEL, tokenizer_dir=llama, text=TINY_LLAMA, vision=TINY_QWEN2VL)
    full = build_demo_tasks(root / "tasks", seed=1, train_per_task=8, eval_per_task=4, progress=lambda _: None)
    spec = yaml.safe_load(full.read_text())
    spec["tasks"] = [task for task in spec["tasks"] if task["name"] in SMALL_TASKS]
    spec["training"] = SMALL_TRAINING
    small = full.with_name("small.yaml")
    small.write_text(yaml.safe_dump(spec, sort_keys=False))
    return FuseSuite(base, small)
