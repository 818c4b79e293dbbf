"""Offline accuracy of an adapter checkpoint, measured with the serving engine itself (in process), so that the
figure is what the served API answers: the same prompt rendering, the same kernels, greedy decoding.

One engine is built over the base checkpoint with the run directory as its adapter store; each checkpoint is
handed to it as the registry would (an AdapterRef with its content digest), and a task's eval examples are
submitted together as chat prompts at temperature 0.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer

from gpu_worker.builder import build_engine
from gpu_worker.engine import Engine
from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.sequence import SamplingParams
from services.common.adapter_layout import ADAPTER_LAYOUTS, CONFIG_FILE, WEIGHTS_FILE, directory_digest
from services.common.config import WorkerConfig
from services.common.lora_config import parse_lora_hyperparameters
from services.common.safetensors_header import read_safetensors_header
from services.common.tower_lora import parse_tower_lora, tower_modules
from services.fuse.data import Example, load_examples
from services.fuse.manifest import Task
from services.fuse.metrics import score
from services.fuse.prompt import served_prompt, target_text

ANSWER_SLACK_TOKENS = 4  # past the longest answer and its EOS: room to be wrong by a few tokens


class EngineEvaluator:
    """Scores checkpoints under `store_root` with one in-process engine over `base_dir` (built on first use)."""

    def __init__(self, base_model: str, base_dir: Path, store_root: Path, rank: int, device: str = "cpu") -> None:
        self.base_model = base_model
        self.base_dir = base_dir
        self.store_root = store_root
        self.rank = rank
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(base_dir)  # the engine's: answers' lengths in its tokens
        self._engine: Engine | None = None
        self._eval_sets: dict[str, list[Example]] = {}

    def accuracy(self, checkpoint: Path, task: Task) -> float:
        examples = self.eval_set(task)
        return score(task, examples, self.answers(checkpoint, examples, self.max_tokens(task, examples)))

    def eval_set(self, task: Task) -> list[Example]:
        if task.name not in self._eval_sets:
            self._eval_sets[task.name] = load_examples(task.eval, task)
        return self._eval_sets[task.name]

    def max_tokens(self, task: Task, examples: Sequence[Example]) -> int:
        longest = max(len(self.tokenizer(target_text(e, task), add_special_tokens=False)["input_ids"]) for e in examples)
        return longest + 1 + ANSWER_SLACK_TOKENS

    def answers(self, checkpoint: Path, examples: Sequence[Example], max_tokens: int) -> list[str]:
        """The served text of each example's chat prompt with the adapter at `checkpoint`, greedy."""
        engine = self.engine()
        adapter = self.adapter_ref(checkpoint)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        requests = [GenerationRequest(f"eval-{i}", served_prompt(e), params, adapter) for i, e in enumerate(examples)]

        async def gather() -> list[str]:
            loop = asyncio.get_running_loop()
            handles = [engine.submit(r, loop) for r in requests]
            return [[out async for out in handle][-1].full_text for handle in handles]
        return asyncio.run(gather())

    def adapter_ref(self, checkpoint: Path) -> AdapterRef:
        """What the registry would record for `checkpoint`: its digest, rank and LoRA parameters on the tower."""
        digest = directory_digest(checkpoint)
        return AdapterRef(f"fuse-{digest[:12]}", self.base_model, self.rank, digest, str(checkpoint),
                          tower_lora_params=self._tower_params(checkpoint))

    def engine(self) -> Engine:
        if self._engine is None:
            worker = WorkerConfig(base_model=self.base_model, device=self.device, cpu_lora_workers=0)
            self._engine = build_engine(self.base_dir, worker, self.store_root)
            self._engine.start()
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.stop()
            self._engine = None

    def _tower_params(self, checkpoint: Path) -> int:
        """The registry's count (registry/adapter_files.py), which the worker checks a tower LoRA against."""
        base_config = json.loads((self.base_dir / "config.json").read_text())
        architecture = base_config["architectures"][0]
        layout = ADAPTER_LAYOUTS[architecture]
        if not layout.vision_prefixes:
            return 0
        tensors = read_safetensors_header(checkpoint / WEIGHTS_FILE)
        hyperparameters = parse_lora_hyperparameters(json.loads((checkpoint / CONFIG_FILE).read_text()))
        spec = parse_tower_lora(layout, {name: info.shape for name, info in tensors.items()},
                                tower_modules(architecture, base_config), hyperparameters, WEIGHTS_FILE)
        return spec.params if spec is not None else 0
