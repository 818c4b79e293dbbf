"""Builds the demo assets locally: a byte-level BPE tokenizer, a random-weight Llama and LoRA adapters.

Nothing is downloaded. The tokenizer is trained on Python source text found on this machine
(the stdlib, in sorted file order, so two builds give the same vocabulary); the model has the real
Llama architecture with random weights; the adapters are real PEFT checkpoints. Every builder
writes into a temporary sibling directory and renames it at the end, so an interrupted build
never leaves a directory that `build_demo_assets` would mistake for a complete one.
"""

from __future__ import annotations

import shutil
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerFast

DEMO_BASE_MODEL = "tessera-demo-llama"

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
TOKENIZER_VOCAB_SIZE = 4096
TOKENIZER_CORPUS_BYTES = 3_000_000  # a few MB: trains in seconds, still learns real merges

# Role-tagged turns; `add_generation_prompt` opens the assistant turn the model completes.
#   <s>user\nHi</s>\n<s>assistant\n
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<s>' + message['role'] + '\\n' + message['content'] + '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)

# Random weights give near-flat logits with the usual 0.02; a wider init makes greedy tokens
# vary along a sequence and keeps top-2 logit gaps far above float noise (ties would make
# token-exact comparisons with transformers meaningless).
INITIALIZER_RANGE = 0.08
# PEFT's init_lora_weights=False draws B like an nn.Linear (tiny for small ranks); scaling it up
# makes every demo adapter visibly change greedy outputs.
LORA_B_GAIN = 4.0

BASE_WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class DemoAdapterSpec:
    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    seed: int


DEMO_ADAPTERS = (
    DemoAdapterSpec("demo-r8", 8, 16.0, ("q_proj", "v_proj"), 1),
    DemoAdapterSpec("demo-r16", 16, 32.0, ("q_proj", "k_proj", "v_proj", "o_proj"), 2),
    DemoAdapterSpec("demo-r64", 64, 64.0,
                    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 3),
)


@dataclass(frozen=True)
class DemoAssets:
    base_dir: Path
    adapter_dirs: dict[str, Path]


def _corpus_files() -> list[Path]:
    """Stdlib sources in sorted order, up to TOKENIZER_CORPUS_BYTES (deterministic per Python version)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chosen: list[Path] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        chosen.append(path)
        total += path.stat().st_size
        if total >= TOKENIZER_CORPUS_BYTES:
            break
    return chosen


def _corpus_lines(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")


def _staging_dir(out_dir: Path) -> Path:
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _publish(staging: Path, out_dir: Path) -> Path:
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir


def build_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (vocab ~4096) with <s>, </s>, <pad> and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(_corpus_files()), trainer=trainer)
    # Like Llama, `tokenizer(text)` prepends BOS; chat prompts carry their own <s> in the template.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=2048, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def _tokenizer_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in TOKENIZER_FILES)


def build_llama(out_dir: Path, *, seed: int = 0, hidden_size: int = 256, num_layers: int = 4,
                num_heads: int = 8, num_kv_heads: int = 4, intermediate_size: int = 688,
                max_position_embeddings: int = 2048, tokenizer_dir: Path | None = None) -> Path:
    """Save a random-weight LlamaForCausalLM (GQA, untied lm_head, float32) with its tokenizer files.

    `tokenizer_dir`: an already built tokenizer to copy (tests share one); None trains a new one.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    staging = _staging_dir(out_dir)
    if tokenizer_dir is not None and _tokenizer_complete(tokenizer_dir):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
        tokenizer.save_pretrained(staging)
    else:
        tokenizer = build_tokenizer(staging)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(staging, safe_serialization=True)
    return _publish(staging, out_dir)


def build_lora_adapter(base_dir: Path, out_dir: Path, spec: DemoAdapterSpec) -> Path:
    """Save a real PEFT LoRA adapter for `base_dir` with random A and B (seeded by spec.seed)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    staging = _staging_dir(out_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(spec.seed)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules),
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(LORA_B_GAIN)
    model.save_pretrained(staging, safe_serialization=True)
    return _publish(staging, out_dir)


def _base_complete(directory: Path) -> bool:
    return (directory / "config.json").is_file() and (directory / BASE_WEIGHTS_FILE).is_file() \
        and _tokenizer_complete(directory)


def _adapter_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in ADAPTER_FILES)


def build_demo_assets(models_dir: Path, progress: Callable[[str], None] = print) -> DemoAssets:
    """Build (or reuse) the demo base model and the DEMO_ADAPTERS under `models_dir`."""
    base_dir = models_dir / DEMO_BASE_MODEL
    if _base_complete(base_dir):
        progress(f"base model {DEMO_BASE_MODEL}: present at {base_dir}")
    else:
        progress(f"base model {DEMO_BASE_MODEL}: training tokenizer and building random weights ...")
        build_llama(base_dir)
        progress(f"base model {DEMO_BASE_MODEL}: written to {base_dir}")
    adapter_dirs: dict[str, Path] = {}
    for index, spec in enumerate(DEMO_ADAPTERS, start=1):
        adapter_dir = models_dir / "adapters" / spec.name
        step = f"adapter {index}/{len(DEMO_ADAPTERS)} {spec.name} (rank {spec.rank})"
        if _adapter_complete(adapter_dir):
            progress(f"{step}: present at {adapter_dir}")
        else:
            build_lora_adapter(base_dir, adapter_dir, spec)
            progress(f"{step}: written to {adapter_dir}")
        adapter_dirs[spec.name] = adapter_dir
    return DemoAssets(base_dir=base_dir, adapter_dirs=adapter_dirs)
