"""transformers + PEFT as the reference every Tessera output is checked against.

`PeftModel.from_pretrained` on the same checkpoint and adapter, greedy `generate`.
The greedy-tie rule (as in vLLM's tests): batched float math may flip an argmax
only where the reference's top-two logits are within TIE_TOLERANCE; at such a
step the two sequences may legitimately diverge, and nothing after it is compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

TIE_TOLERANCE = 1e-5


@dataclass
class Greedy:
    tokens: list[int]          # generated ids, up to and including EOS (as `generate` returns them)
    top2_gaps: list[float]     # per step: top-1 minus top-2 reference logit


class ReferenceModels:
    """The base checkpoint plus named PEFT adapter directories, loaded lazily."""

    def __init__(self, base_name: str, base_dir: Path, adapter_dirs: dict[str, Path]) -> None:
        self.base_name = base_name
        self.base_dir = Path(base_dir)
        self.adapter_dirs = {name: Path(d) for name, d in adapter_dirs.items()}
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_dir)
        self._models: dict[str, PreTrainedModel] = {}

    def model(self, name: str) -> PreTrainedModel:
        if name not in self._models:
            base = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32)
            model = base if name == self.base_name else PeftModel.from_pretrained(base, self.adapter_dirs[name])
            self._models[name] = model.eval()
        return self._models[name]

    def greedy_ids(self, name: str, prompt_ids: list[int], max_new_tokens: int) -> Greedy:
        with torch.no_grad():
            out = self.model(name).generate(
                input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                do_sample=False, max_new_tokens=max_new_tokens, output_scores=True, return_dict_in_generate=True,
                pad_token_id=self.tokenizer.pad_token_id)
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        if self.tokenizer.eos_token_id in tokens:
            cut = tokens.index(self.tokenizer.eos_token_id) + 1
            tokens, gaps = tokens[:cut], gaps[:cut]
        return Greedy(tokens, gaps)

    def greedy_chat(self, name: str, messages: list[dict[str, str]], max_new_tokens: int) -> Greedy:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return self.greedy_ids(name, list(ids), max_new_tokens)

    def greedy_text(self, name: str, prompt: str, max_new_tokens: int) -> Greedy:
        return self.greedy_ids(name, self.tokenizer(prompt).input_ids, max_new_tokens)

    def decode(self, name: str, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def assert_same_greedy(reference: ReferenceModels, name: str, expected: Greedy, actual: list[int]) -> None:
    """Token-for-token equality, except after a step whose reference top-2 gap is a tie."""
    for step, (want, got) in enumerate(zip(expected.tokens, actual)):
        if want != got:
            gap = expected.top2_gaps[step]
            assert gap < TIE_TOLERANCE, (
                f"{name}: token {step} differs ({got} != {want}) and the reference top-2 gap {gap:.3g} is no tie")
            return
    assert len(actual) == len(expected.tokens), f"{name}: {len(actual)} tokens != reference {len(expected.tokens)}"
