"""PeftTrainer and EngineEvaluator on the tiny Qwen2-VL: training lowers the loss and saves a PEFT checkpoint,
the prompts it trains on are the worker's token for token, and the evaluator's accuracy is the served answers'."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gpu_worker.builder import build_engine
from gpu_worker.intake import GenerationRequest
from gpu_worker.prompts import PromptEncoder
from gpu_worker.sequence import SamplingParams
from gpu_worker.vision.qwen2vl_processor import Qwen2VLPromptProcessor
from services.common.config import WorkerConfig
from services.demo_assets import DEMO_QWEN2VL_BASE_MODEL
from services.fuse.data import load_examples
from services.fuse.evaluate import EngineEvaluator
from services.fuse.manifest import load_manifest
from services.fuse.metrics import score
from services.fuse.prompt import served_prompt
from services.fuse.trainer import IGNORE, PeftTrainer

from .conftest import FuseSuite


@pytest.fixture(scope="module")
def trained(fuse_suite: FuseSuite, tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("run")
    manifest = load_manifest(fuse_suite.manifest)
    evaluator = EngineEvaluator(DEMO_QWEN2VL_BASE_MODEL, fuse_suite.base_dir, run_dir, manifest.training.rank)
    trainer = PeftTrainer(fuse_suite.base_dir, manifest, run_dir, evaluator, progress=lambda _: None)
    fresh = trainer.start()
    state = trainer.train(fresh, "squares")
    yield trainer, evaluator, fresh, state
    evaluator.close()


def test_training_lowers_the_loss_and_saves_a_peft_checkpoint(trained) -> None:
    trainer, _, fresh, state = trained
    assert trainer.loss(state, "squares") < trainer.loss(fresh, "squares") - 0.1
    checkpoint = trainer.run_dir / state
    assert checkpoint.parent == trainer.run_dir / "checkpoints" and checkpoint != trainer.run_dir / fresh
    assert {p.name for p in checkpoint.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert trainer.train(fresh, "squares") != state  # a new state each time; the old one stays
    assert (trainer.run_dir / state).is_dir()


def test_training_prompts_are_the_workers(trained, fuse_suite: FuseSuite) -> None:
    trainer = trained[0]
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(fuse_suite.base_dir), 2048,
                            Qwen2VLPromptProcessor.from_pretrained(fuse_suite.base_dir))
    task = trainer.tasks["squares"]
    for example, encoded in zip(load_examples(task.train, task), trainer.encoded("squares", "train")):
        prompt = (encoded["labels"][0] == IGNORE).sum().item()
        assert encoded["input_ids"][0, :prompt].tolist() == encoder.encode(served_prompt(example), 16).token_ids
        assert encoded["input_ids"][0, -1].item() == trainer.tokenizer.eos_token_id


def test_evaluator_accuracy_is_the_engines(trained, fuse_suite: FuseSuite) -> None:
    trainer, evaluator, _, state = trained
    checkpoint = trainer.run_dir / state
    engine = build_engine(fuse_suite.base_dir, WorkerConfig(base_model=DEMO_QWEN2VL_BASE_MODEL, cpu_lora_workers=0),
                          trainer.run_dir)
    engine.start()
    try:
        for name in ("shape", "squares"):
            task = trainer.tasks[name]
            examples = evaluator.eval_set(task)
            params = SamplingParams(temperature=0.0, max_tokens=evaluator.max_tokens(task, examples))
            ref = evaluator.adapter_ref(checkpoint)

            async def served() -> list[str]:
                loop = asyncio.get_running_loop()
                handles = [engine.submit(GenerationRequest(f"{name}-{i}", served_prompt(e), params, ref), loop)
                           for i, e in enumerate(examples)]
                return [[out async for out in handle][-1].full_text for handle in handles]
            answers = asyncio.run(served())
            assert evaluator.answers(checkpoint, examples, params.max_tokens) == answers
            assert evaluator.accuracy(checkpoint, task) == score(task, examples, answers)
    finally:
        engine.stop()
