"""Trains `tessera fuse`'s adapters: policy.fusion's Trainer over a base model checkpoint, with transformers +
PEFT (float32, on the device `tessera fuse` picks: CUDA when present). A state is a PEFT checkpoint directory
(adapter_config.json + adapter_model.safetensors), named by its path relative to the run directory ("checkpoints/0003"), so the
journal holding it stays valid when the run directory moves.

Training targets what the served engine will be asked: each example's prompt rendered exactly as the worker
renders a chat request (gpu_worker/prompts.py: the processor's chat template with the assistant turn opened,
images and video frames decoded by the worker's own decoders), followed by the answer's tokens and EOS; the
loss counts the answer's tokens only.
    ids:    <s>user\\n<|vision_start|><|image_pad|>... What shape is this?</s>\\n<s>assistant\\n circle </s>
    labels: -100 ...                                                                       circle </s>
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from peft.utils import load_peft_weights
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor,
                          AutoTokenizer)

from gpu_worker.prompts import ChatMessage, ImagePart, Prompt
from gpu_worker.vision.images import decode_image
from gpu_worker.vision.qwen2vl_processor import Qwen2VLPromptProcessor
from gpu_worker.vision.video import VideoPart, decode_video
from services.fuse.data import Example, load_examples
from services.fuse.manifest import Manifest, Task
from services.fuse.prompt import served_prompt, target_text

CHECKPOINTS = "checkpoints"
IGNORE = -100  # labels transformers' loss skips: the prompt's tokens and the padding
# Per-token inputs, padded to the batch's longest; every other input (pixels, grids) is concatenated.
TOKEN_INPUTS = {"input_ids": 0, "attention_mask": 0, "mm_token_type_ids": 0, "labels": IGNORE}
VISION_MODEL_TYPES = ("llava", "qwen2_vl")


class Evaluator(Protocol):
    def accuracy(self, checkpoint: Path, task: Task) -> float:
        """`task`'s metric on its eval set, served with the adapter at `checkpoint`."""


def processor_messages(prompt: Prompt, vision: bool) -> list[dict[str, Any]]:
    """`prompt` in the processor's form, decoded as PromptEncoder decodes a request (gpu_worker/prompts.py);
    a text model's messages as plain text."""
    messages = []
    for message in prompt:
        parts = (message.content,) if isinstance(message.content, str) else message.content
        if not vision:
            assert all(isinstance(p, str) for p in parts), "a text model takes no images or video"
            messages.append({"role": message.role, "content": "".join(str(p) for p in parts)})
            continue
        content: list[dict[str, Any]] = []
        images = videos = 0
        for part in parts:
            if isinstance(part, ImagePart):
                content.append({"type": "image", "image": decode_image(part.data, images)})
                images += 1
            elif isinstance(part, VideoPart):
                content.append({"type": "video", "video": decode_video(part, videos)})
                videos += 1
            else:
                content.append({"type": "text", "text": part})
        messages.append({"role": message.role, "content": content})
    return messages


def collate(features: Sequence[dict[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    """Examples of shape {input_ids: [1, n_i], ...} -> one batch, right-padded to the longest n_i."""
    longest = max(f["input_ids"].shape[1] for f in features)
    batch: dict[str, torch.Tensor] = {}
    for key in features[0]:
        if key in TOKEN_INPUTS:
            rows = [torch.nn.functional.pad(f[key], (0, longest - f[key].shape[1]), value=TOKEN_INPUTS[key])
                    for f in features]
        else:
            rows = [f[key] for f in features]
        batch[key] = torch.cat(rows).to(device)
    return batch


class PeftTrainer:
    """policy.fusion's Trainer: one PEFT LoRA model in memory, its weights swapped in from each state."""

    def __init__(self, base_dir: Path, manifest: Manifest, run_dir: Path, evaluator: Evaluator,
                 device: str = "cpu", progress: Callable[[str], None] = print) -> None:
        self.manifest = manifest
        self.run_dir = run_dir
        self.evaluator = evaluator
        self.progress = progress
        self.tasks = {task.name: task for task in manifest.tasks}
        self.device = torch.device(device)
        config = AutoConfig.from_pretrained(base_dir)
        self.vision = config.model_type in VISION_MODEL_TYPES
        self.tokenizer = AutoTokenizer.from_pretrained(base_dir)
        # The worker's processors (gpu_worker/models/families.py): Qwen2-VL's own, since transformers' needs torchvision.
        self.processor: Any = None
        if config.model_type == "qwen2_vl":
            self.processor = Qwen2VLPromptProcessor.from_pretrained(base_dir)
        elif self.vision:
            self.processor = AutoProcessor.from_pretrained(base_dir)
        auto = AutoModelForImageTextToText if self.vision else AutoModelForCausalLM
        base = auto.from_pretrained(base_dir, dtype=torch.float32)
        training = manifest.training
        targets: list[str] | str = list(training.target_modules)
        if self.vision and not training.tower:
            # A regex over module paths: bare names would match the vision tower's projections too.
            targets = rf".*language_model.*\.({'|'.join(training.target_modules)})"
        lora = LoraConfig(r=training.rank, lora_alpha=training.alpha, target_modules=targets, lora_dropout=0.0,
                          bias="none", task_type="CAUSAL_LM")
        torch.manual_seed(manifest.seed)  # the fresh adapter's A; its B is zero, so it starts as the base model
        self.model = get_peft_model(base, lora).to(self.device)
        self.fresh = {name: p.detach().clone() for name, p in self.model.named_parameters() if p.requires_grad}
        self._encoded: dict[tuple[str, str], list[dict[str, torch.Tensor]]] = {}

    def start(self) -> str:
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name in self.fresh:
                    param.copy_(self.fresh[name])
        return self._save()

    def train(self, state: str, task: str) -> str:
        self._load(state)
        examples = self.encoded(task, "train")
        training = self.manifest.training
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=training.learning_rate)
        order = torch.Generator().manual_seed(self.manifest.seed)
        torch.manual_seed(self.manifest.seed)
        self.model.train()
        for epoch in range(training.epochs):
            total, batches = 0.0, 0
            permutation = torch.randperm(len(examples), generator=order).tolist()
            for start in range(0, len(examples), training.batch_size):
                batch = [examples[i] for i in permutation[start:start + training.batch_size]]
                loss = self.model(**collate(batch, self.device)).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                total, batches = total + loss.item(), batches + 1
            self.progress(f"  train {task}: epoch {epoch + 1}/{training.epochs}, loss {total / batches:.4f}")
        return self._save()

    def evaluate(self, state: str, task: str) -> float:
        return self.evaluator.accuracy(self.run_dir / state, self.tasks[task])

    def loss(self, state: str, task: str, split: str = "train") -> float:
        """The mean loss over `task`'s `split` examples at `state` (each example's answer tokens averaged)."""
        self._load(state)
        self.model.eval()
        with torch.no_grad():
            losses = [self.model(**collate([e], self.device)).loss.item() for e in self.encoded(task, split)]
        return sum(losses) / len(losses)

    def encoded(self, task: str, split: str) -> list[dict[str, torch.Tensor]]:
        key = (task, split)
        if key not in self._encoded:
            spec = self.tasks[task]
            path = spec.train if split == "train" else spec.eval
            self._encoded[key] = [self._encode(e, spec) for e in load_examples(path, spec)]
        return self._encoded[key]

    def _encode(self, example: Example, task: Task) -> dict[str, torch.Tensor]:
        """The prompt as the worker renders it, then the answer and EOS; labels only on the latter."""
        messages = processor_messages(served_prompt(example), self.vision)
        if self.processor is not None:
            inputs = dict(self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                             return_dict=True, return_tensors="pt"))
        else:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            inputs = dict(self.tokenizer(text, add_special_tokens=False, return_tensors="pt"))
        answer = self.tokenizer(target_text(example, task), add_special_tokens=False)["input_ids"]
        answer = torch.tensor([answer + [self.tokenizer.eos_token_id]])
        prompt_ids = inputs["input_ids"]
        inputs["input_ids"] = torch.cat([prompt_ids, answer], dim=1)
        inputs["labels"] = torch.cat([torch.full_like(prompt_ids, IGNORE), answer], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        if "mm_token_type_ids" in inputs:
            inputs["mm_token_type_ids"] = torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, answer.shape[1]))
        return {key: value for key, value in inputs.items() if isinstance(value, torch.Tensor)}

    def _load(self, state: str) -> None:
        weights = load_peft_weights(str(self.run_dir / state), device=str(self.device))
        result = set_peft_model_state_dict(self.model, weights)
        assert not result.unexpected_keys, f"{state}: unexpected tensors {result.unexpected_keys[:4]}"

    def _save(self) -> str:
        """The model's adapter saved as a new checkpoint directory (staged, then renamed: never half written)."""
        root = self.run_dir / CHECKPOINTS
        root.mkdir(parents=True, exist_ok=True)
        index = len([p for p in root.iterdir() if not p.name.endswith(".partial")])
        while (root / f"{index:04d}").exists():
            index += 1
        final = root / f"{index:04d}"
        staging = root / f"{final.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        self.model.save_pretrained(staging, safe_serialization=True)
        staging.rename(final)
        return final.relative_to(self.run_dir).as_posix()
