"""Fixtures: a tiny real Llama checkpoint and real PEFT LoRA adapters, built once per session."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from registry.db import upgrade_schema
from registry.store import RegistryStore

from .head_adapters import detection_head, mlp_head, write_head_adapter

if TYPE_CHECKING:
    from transformers import LlamaConfig

BASE_MODEL = "tiny-llama"
# name -> (r, target_modules)
ADAPTERS: dict[str, tuple[int, list[str]]] = {
    "all-proj": (4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "attn-qv": (2, ["q_proj", "v_proj"]),
}


class FakeClock:
    """A settable wall clock (unix seconds) for heartbeat timeouts."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("assets")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=128, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(root / "base")
    for name, (rank, targets) in ADAPTERS.items():
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        get_peft_model(LlamaForCausalLM(config), lora).save_pretrained(root / name)
    # rsLoRA with per-module ranks (layer 1's q_proj at 8: the largest) and alphas.
    patterns = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True,
                          rank_pattern={"layers.1.self_attn.q_proj": 8, "v_proj": 1}, alpha_pattern={"k_proj": 3},
                          init_lora_weights=False)
    get_peft_model(LlamaForCausalLM(config), patterns).save_pretrained(root / "rslora-patterns")
    _write_head_adapters(root, config)
    return root


# The task-head adapters' labels (docs/task-heads.md); their heads: test_task_head_adapters.py.
SEQ_CLS_LABELS = ["negative", "neutral", "positive"]
MLP_TASK_HEAD = {"kind": "mlp", "labels": ["walk", "run", "jump"], "activation": "gelu"}
DETECTION_TASK_HEAD = {"kind": "detection", "labels": ["person", "car"], "num_queries": 8, "box_format": "xyxy",
                       "score_threshold": 0.3}


def _write_head_adapters(root: Path, config: LlamaConfig) -> None:
    """seq-cls/ (PEFT's SEQ_CLS on a LlamaForSequenceClassification, id2label added as users do), mlp-head/ and
    detection-head/ (VaLoRA heads written with plain torch)."""
    import copy
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForSequenceClassification

    classifier_config = copy.deepcopy(config)
    classifier_config.num_labels = len(SEQ_CLS_LABELS)
    lora = LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"])
    get_peft_model(LlamaForSequenceClassification(classifier_config), lora).save_pretrained(root / "seq-cls")
    adapter_config = root / "seq-cls" / "adapter_config.json"
    adapter_config.write_text(json.dumps({**json.loads(adapter_config.read_text()),
                                          "id2label": dict(enumerate(SEQ_CLS_LABELS))}))
    write_head_adapter(root / "mlp-head", mlp_head(3), {"task_head": MLP_TASK_HEAD})
    write_head_adapter(root / "detection-head", detection_head(2), {"task_head": DETECTION_TASK_HEAD})


@pytest.fixture
def imports(tmp_path: Path, assets: Path) -> Path:
    """A per-test import root holding copies of the assets (tests may damage them)."""
    root = tmp_path / "imports"
    shutil.copytree(assets, root)
    return root


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


def _new_database(request: pytest.FixtureRequest, tmp_path: Path, migrated: bool) -> str:
    """A new database: a SQLite file (the embedded default), or one on the session's PostgreSQL server."""
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_server").new_database(migrated)
    url = f"sqlite:///{tmp_path / 'db' / 'registry.db'}"
    if migrated:
        upgrade_schema(url)
    return url


@pytest.fixture(params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new database at schema head, on each backend."""
    return _new_database(request, tmp_path, migrated=True)


@pytest.fixture(params=BACKENDS)
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new database without any table, on each backend."""
    return _new_database(request, tmp_path, migrated=False)


@pytest.fixture
def store(database_url: str, tmp_path: Path, imports: Path, clock: FakeClock) -> Iterator[RegistryStore]:
    url = database_url
    upgrade_schema(url)
    registry = RegistryStore(url, tmp_path / "store", [imports], worker_timeout_s=10.0, clock=clock)
    registry.register_base_model(BASE_MODEL, str(imports / "base"))
    yield registry
    registry.close()
