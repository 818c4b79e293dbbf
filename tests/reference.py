"""transformers + PEFT as the reference every Tessera output is checked against.

`PeftModel.from_pretrained` on the same checkpoint and adapter, greedy `generate` (for a
vision-language model, on what its processor makes of the same messages and images). Task heads:
PEFT's AutoModelForSequenceClassification for a SEQ_CLS adapter; VaLoRA's heads in plain torch over the
reference's final hidden states.
The greedy-tie rule (as in vLLM's tests): batched float math may flip an argmax
only where the reference's top-two log-probabilities are within TIE_TOLERANCE; at
such a step our token must be one of the tied ones, and the continuations may
legitimately diverge after it, so nothing later is compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from peft import PeftModel
from safetensors import safe_open
from transformers import (AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification,
                          AutoProcessor, AutoTokenizer, PreTrainedModel)

from services.common.adapter_layout import WEIGHTS_FILE
from services.common.task_heads import TaskHead

TIE_TOLERANCE = 1e-5


@dataclass
class Greedy:
    tokens: list[int]               # generated ids, up to and including EOS (as `generate` returns them)
    logprobs: list[torch.Tensor]    # per step: [vocab] float64 log-probabilities of the reference


class ReferenceModels:
    """The base checkpoint plus named PEFT adapter directories, loaded lazily on `device`."""

    auto_model: Any = AutoModelForCausalLM

    def __init__(self, base_name: str, base_dir: Path, adapter_dirs: dict[str, Path],
                 device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.base_name = base_name
        self.base_dir = Path(base_dir)
        self.adapter_dirs = {name: Path(d) for name, d in adapter_dirs.items()}
        self.device, self.dtype = device, dtype
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_dir)
        self._models: dict[str, PreTrainedModel] = {}

    def model(self, name: str) -> PreTrainedModel:
        if name not in self._models:
            base = self.auto_model.from_pretrained(self.base_dir, dtype=self.dtype).to(self.device)
            model = base if name == self.base_name else PeftModel.from_pretrained(base, self.adapter_dirs[name])
            self._models[name] = model.eval()
        return self._models[name]

    def greedy_inputs(self, name: str, inputs: Mapping[str, torch.Tensor], max_new_tokens: int) -> Greedy:
        """`inputs`: one prompt's model inputs (input_ids [1, n], and pixel_values etc. where the model takes them)."""
        inputs = {key: value.to(self.device) for key, value in inputs.items()}
        inputs.setdefault("attention_mask", torch.ones_like(inputs["input_ids"]))
        with torch.no_grad():
            out = self.model(name).generate(
                **inputs, do_sample=False, max_new_tokens=max_new_tokens, output_logits=True,
                return_dict_in_generate=True, pad_token_id=self.tokenizer.pad_token_id)
        tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        logprobs = [torch.log_softmax(step[0].double().cpu(), dim=-1) for step in out.logits]
        return Greedy(tokens, logprobs[:len(tokens)])

    def final_hidden(self, name: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The language model's final (normed) hidden states of one prompt: [tokens, hidden]."""
        model = self.model(name)
        inner = (model.base_model.model if isinstance(model, PeftModel) else model).model
        inputs = {key: value.to(self.device) for key, value in inputs.items()}
        with torch.no_grad():
            return inner(**inputs).last_hidden_state[0]

    def greedy_ids(self, name: str, prompt_ids: list[int], max_new_tokens: int) -> Greedy:
        return self.greedy_inputs(name, {"input_ids": torch.tensor([prompt_ids])}, max_new_tokens)

    def greedy_chat(self, name: str, messages: list[dict[str, str]], max_new_tokens: int) -> Greedy:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return self.greedy_ids(name, list(ids), max_new_tokens)

    def greedy_text(self, name: str, prompt: str, max_new_tokens: int) -> Greedy:
        return self.greedy_ids(name, self.tokenizer(prompt).input_ids, max_new_tokens)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


class VisionReferenceModels(ReferenceModels):
    """A vision-language checkpoint (LlavaForConditionalGeneration, ...) and its processor: AutoProcessor's,
    or `processor` where that cannot be built (Qwen2-VL without torchvision)."""

    auto_model = AutoModelForImageTextToText

    def __init__(self, base_name: str, base_dir: Path, adapter_dirs: dict[str, Path],
                 device: str = "cpu", dtype: torch.dtype = torch.float32, processor: Any = None) -> None:
        super().__init__(base_name, base_dir, adapter_dirs, device, dtype)
        self.processor = processor or AutoProcessor.from_pretrained(self.base_dir)

    def greedy_messages(self, name: str, messages: list[dict[str, Any]], max_new_tokens: int) -> Greedy:
        """`messages` in the processor's form: content parts {"type": "text", "text": ...} and
        {"type": "image", "image": <PIL image>}."""
        return self.greedy_inputs(name, self.message_inputs(messages), max_new_tokens)

    def message_inputs(self, messages: list[dict[str, Any]]) -> Mapping[str, torch.Tensor]:
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True, return_tensors="pt")


def assert_same_greedy(name: str, expected: Greedy, actual: list[int]) -> None:
    """Token-for-token equality, except at a genuine tie of the reference's top two."""
    for step, (want, got) in enumerate(zip(expected.tokens, actual)):
        if want == got:
            continue
        logprobs = expected.logprobs[step]
        top2 = logprobs.topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < TIE_TOLERANCE, f"{name}: token {step} differs ({got} != {want}), top-2 gap {gap:.3g} is no tie"
        assert float(logprobs[want] - logprobs[got]) < TIE_TOLERANCE, f"{name}: token {got} at step {step} is not a tied top token"
        return  # past a tie the continuations legitimately diverge
    assert len(actual) == len(expected.tokens), f"{name}: {len(actual)} tokens != reference {len(expected.tokens)}"


def peft_classifier_probs(base_dir: Path, adapter_dir: Path, num_labels: int, prompt: str) -> torch.Tensor:
    """transformers + PEFT: AutoModelForSequenceClassification with a SEQ_CLS adapter (its score head
    included) on a text prompt, float32: the label probabilities."""
    base = AutoModelForSequenceClassification.from_pretrained(base_dir, dtype=torch.float32, num_labels=num_labels)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(**AutoTokenizer.from_pretrained(base_dir)(prompt, return_tensors="pt")).logits[0].softmax(-1)


def head_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    """A VaLoRA head's tensors by their names under task_head. ("fc1.weight")."""
    with safe_open(Path(adapter_dir) / WEIGHTS_FILE, "pt") as f:
        return {name.removeprefix("base_model.model.task_head."): f.get_tensor(name) for name in f.keys()
                if ".task_head." in name}


_ACTIVATIONS = {"none": lambda x: x, "relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh}


def mlp_head_probs(tensors: Mapping[str, torch.Tensor], head: TaskHead, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [tokens, hidden size]: the last token through fc1, the activation, fc2, softmax."""
    inner = _ACTIVATIONS[head.activation](hidden[-1] @ tensors["fc1.weight"].T + tensors["fc1.bias"])
    return (inner @ tensors["fc2.weight"].T + tensors["fc2.bias"]).softmax(-1)


def detection_head_boxes(tensors: Mapping[str, torch.Tensor], head: TaskHead,
                         hidden: torch.Tensor) -> list[tuple[str, float, list[float]]]:
    """DETR's post-processing on the last num_queries positions: each query's best real class and its
    probability, kept at or above the threshold, its box cxcywh -> xyxy in [0, 1]; best first."""
    queries = hidden[-head.positions:]
    probs = (queries @ tensors["class_embed.weight"].T + tensors["class_embed.bias"]).softmax(-1)
    box = queries
    for layer in range(3):
        box = box @ tensors[f"bbox_embed.layers.{layer}.weight"].T + tensors[f"bbox_embed.layers.{layer}.bias"]
        box = box.relu() if layer < 2 else box.sigmoid()
    found = []
    for query in range(head.positions):
        score, label = probs[query, :-1].max(-1)
        x, y, w, h = box[query].tolist()
        if head.box_format == "cxcywh":
            x, y, w, h = x - w / 2, y - h / 2, x + w / 2, y + h / 2
        if score >= head.score_threshold:
            found.append((head.labels[label], score.item(), [min(1.0, max(0.0, v)) for v in (x, y, w, h)]))
    return sorted(found, key=lambda d: -d[1])
