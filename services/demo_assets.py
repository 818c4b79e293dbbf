"""Builds the demo assets locally: a byte-level BPE tokenizer, a random-weight Llama, a random-weight
LLaVA-1.5 (CLIP vision tower + projector + that Llama's architecture), a random-weight Qwen2-VL (ViT +
patch merger + a Qwen2 language model with M-RoPE) and LoRA adapters for all three.

Nothing is downloaded. The tokenizer is trained on Python source text found on this machine
(the stdlib, in sorted file order, so two builds give the same vocabulary); the models have the real
architectures with random weights; the LLaVA model has a working processor (image processor,
tokenizer with <image>, chat template), the Qwen2-VL model its processor's parts (image processor,
tokenizer with the vision tokens and chat template); the adapters are real PEFT checkpoints. Every builder
writes into a temporary sibling directory and renames it at the end, so an interrupted build
never leaves a directory that `build_demo_assets` would mistake for a complete one.
"""

from __future__ import annotations

import shutil
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from transformers import LlamaConfig, PreTrainedTokenizerFast

from services.demo_heads import HEAD_INIT_STD, DemoHead, add_head_files

DEMO_BASE_MODEL = "tessera-demo-llama"          # what the embedded default serves
DEMO_VISION_BASE_MODEL = "tessera-demo-llava"   # for a worker configured with this base_model
DEMO_QWEN2VL_BASE_MODEL = "tessera-demo-qwen2vl"  # likewise

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
# The same turns with content parts (the processor's message form); an image part renders as the
# placeholder, which the processor expands to one <image> token per image feature.
#   <s>user\nWhat is this? <image></s>\n<s>assistant\n
IMAGE_TOKEN = "<image>"
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<s>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)

# Qwen2-VL's placeholders: the processor expands <|image_pad|> (<|video_pad|>) to one token per merged patch.
#   <s>user\nWhat is this? <|vision_start|><|image_pad|><|vision_end|></s>\n<s>assistant\n
QWEN2VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN2VL_CHAT_TEMPLATE = VISION_CHAT_TEMPLATE.replace(
    "{% if part['type'] == 'image' %}{{ '<image>' }}",
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}")

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
PROCESSOR_FILES = ("processor_config.json",)
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json",)


@dataclass(frozen=True)
class DemoAdapterSpec:
    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    seed: int
    # PEFT's per-module options: (module name or regex, value) pairs, in order; rsLoRA scaling alpha / sqrt(r).
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    use_rslora: bool = False
    head: DemoHead | None = None  # a task head (services/demo_heads.py)
    # A vision-language model: bare target names, so PEFT adapts the vision tower's (and projector's) linears
    # of those names too (docs/tower-lora.md); False keeps the adapter on the language model.
    tower: bool = False


DEMO_ADAPTERS = (
    DemoAdapterSpec("demo-r8", 8, 16.0, ("q_proj", "v_proj"), 1),
    DemoAdapterSpec("demo-r16", 16, 32.0, ("q_proj", "k_proj", "v_proj", "o_proj"), 2),
    DemoAdapterSpec("demo-r64", 64, 64.0,
                    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 3),
)
# On the LLaVA and Qwen2-VL models' language models only.
DEMO_VISION_ADAPTERS = (
    DemoAdapterSpec("demo-llava-r8", 8, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj"), 4),
    DemoAdapterSpec("demo-llava-r16", 16, 32.0,
                    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 5),
)
# LoRA on the LLaVA model's CLIP tower as well as its language model: PEFT's bare q_proj / v_proj.
DEMO_VISION_TOWER_ADAPTERS = (DemoAdapterSpec("demo-llava-tower", 8, 16.0, ("q_proj", "v_proj"), 14, tower=True),)
DEMO_QWEN2VL_ADAPTERS = (
    DemoAdapterSpec("demo-qwen2vl-r8", 8, 16.0,
                    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 6),
    DemoAdapterSpec("demo-qwen2vl-r16", 16, 32.0, ("q_proj", "k_proj", "v_proj", "o_proj"), 7),
)
# Adapters with task heads (docs/task-heads.md), answered by POST /v1/classify: a PEFT SEQ_CLS classifier on
# the text model, VaLoRA's action-recognition MLP head on Qwen2-VL and its detection head on LLaVA.
DEMO_HEAD_ADAPTERS = (
    DemoAdapterSpec("demo-classifier", 8, 16.0, ("q_proj", "v_proj"), 11,
                    head=DemoHead("classifier", ("negative", "neutral", "positive"))),
)
DEMO_QWEN2VL_HEAD_ADAPTERS = (
    DemoAdapterSpec("demo-qwen2vl-action", 8, 16.0, ("q_proj", "v_proj"), 12,
                    head=DemoHead("mlp", ("walking", "running", "jumping", "sitting"))),
)
DEMO_VISION_HEAD_ADAPTERS = (
    DemoAdapterSpec("demo-llava-detect", 8, 16.0, ("q_proj", "v_proj"), 13,
                    head=DemoHead("detection", ("cat", "dog", "car"), num_queries=4)),
)


@dataclass(frozen=True)
class DemoAssets:
    """One demo base model and its adapters."""
    base_dir: Path
    adapter_dirs: dict[str, Path]
    name: str = DEMO_BASE_MODEL


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


def _tokenizer(tokenizer_dir: Path | None, staging: Path) -> PreTrainedTokenizerFast:
    """The tokenizer in `tokenizer_dir` (tests and the LLaVA model share one), else a newly trained one."""
    if tokenizer_dir is not None and _tokenizer_complete(tokenizer_dir):
        return PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    return build_tokenizer(staging)


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 688
    max_position_embeddings: int = 2048


@dataclass(frozen=True)
class ClipShape:
    """A CLIP vision tower: (image_size / patch_size)^2 patches, each one image token (LLaVA-1.5: 336/14)."""
    image_size: int = 64
    patch_size: int = 16
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4


def _llama_config(tokenizer: PreTrainedTokenizerFast, shape: LlamaShape) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def build_llama(out_dir: Path, *, seed: int = 0, shape: LlamaShape = LlamaShape(),
                tokenizer_dir: Path | None = None) -> Path:
    """Save a random-weight LlamaForCausalLM (GQA, untied lm_head, float32) with its tokenizer files.

    `tokenizer_dir`: an already built tokenizer to copy (tests share one); None trains a new one.
    """
    import torch
    from transformers import LlamaForCausalLM

    staging = _staging_dir(out_dir)
    tokenizer = _tokenizer(tokenizer_dir, staging)
    tokenizer.save_pretrained(staging)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(tokenizer, shape)).to(torch.float32).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(staging, safe_serialization=True)
    return _publish(staging, out_dir)


def build_llava(out_dir: Path, *, tokenizer_dir: Path | None, seed: int = 0, text: LlamaShape = LlamaShape(),
                vision: ClipShape = ClipShape()) -> Path:
    """Save a random-weight LLaVA-1.5 (CLIP tower, 2-layer GELU projector, Llama; float32) with a working
    LlavaProcessor: the tokenizer of `tokenizer_dir` plus <image>, a CLIP image processor, the chat template."""
    import torch
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers import LlavaProcessor

    staging = _staging_dir(out_dir)
    tokenizer = _tokenizer(tokenizer_dir, staging)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    vision_config = CLIPVisionConfig(
        image_size=vision.image_size, patch_size=vision.patch_size, hidden_size=vision.hidden_size,
        intermediate_size=4 * vision.hidden_size, num_hidden_layers=vision.num_layers,
        num_attention_heads=vision.num_heads, projection_dim=vision.hidden_size)
    patches = (vision.image_size // vision.patch_size) ** 2
    # LLaVA-1.5's choices: the second-to-last layer's features, CLS dropped: one token per patch.
    config = LlavaConfig(vision_config=vision_config, text_config=_llama_config(tokenizer, text),
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), image_seq_length=patches,
                         vision_feature_layer=-2, vision_feature_select_strategy="default", dtype="float32")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(staging, safe_serialization=True)
    # The processor counts patches + 1 (CLS) tokens per image, less 1 under the "default" strategy.
    image_processor = CLIPImageProcessor(size={"shortest_edge": vision.image_size},
                                         crop_size={"height": vision.image_size, "width": vision.image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=vision.patch_size,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=VISION_CHAT_TEMPLATE)
    processor.save_pretrained(staging)
    return _publish(staging, out_dir)


@dataclass(frozen=True)
class Qwen2VLVisionShape:
    """Qwen2-VL's ViT: patch_size px patches, merge x merge of them one image token; images resized to
    multiples of patch_size * merge with min_pixels..max_pixels pixels (48 x 48 px: 9 tokens)."""
    embed_dim: int = 32
    depth: int = 2
    num_heads: int = 4
    patch_size: int = 8
    merge: int = 2
    min_pixels: int = 16 * 16
    max_pixels: int = 48 * 48


def build_qwen2vl(out_dir: Path, *, tokenizer_dir: Path | None, seed: int = 0, text: LlamaShape = LlamaShape(),
                  vision: Qwen2VLVisionShape = Qwen2VLVisionShape()) -> Path:
    """Save a random-weight Qwen2-VL (its ViT and patch merger, a Qwen2 language model with M-RoPE; float32)
    with its processor's parts: the tokenizer of `tokenizer_dir` plus the vision tokens and the chat
    template, a small image processor (preprocessor_config.json). The M-RoPE sections split the head's
    frequencies as Qwen2-VL's (16, 24, 24) of 64 do."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    staging = _staging_dir(out_dir)
    tokenizer = _tokenizer(tokenizer_dir, staging)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN2VL_TOKENS)})
    tokenizer.chat_template = QWEN2VL_CHAT_TEMPLATE
    ids = dict(zip(QWEN2VL_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN2VL_TOKENS))))
    half = text.hidden_size // text.num_heads // 2
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # (temporal, height, width) frequencies
    text_config = dict(
        vocab_size=len(tokenizer), hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
        num_hidden_layers=text.num_layers, num_attention_heads=text.num_heads,
        num_key_value_heads=text.num_kv_heads, max_position_embeddings=text.max_position_embeddings,
        initializer_range=INITIALIZER_RANGE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                              "mrope_section": section},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    vision_config = dict(depth=vision.depth, embed_dim=vision.embed_dim, hidden_size=text.hidden_size,
                         num_heads=vision.num_heads, patch_size=vision.patch_size,
                         spatial_merge_size=vision.merge, initializer_range=INITIALIZER_RANGE)
    config = Qwen2VLConfig(text_config=text_config, vision_config=vision_config,
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                           tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(staging, safe_serialization=True)
    # Qwen2VLProcessor cannot be built without torchvision (its video processor): its two image parts
    # are saved instead, which the worker reads (gpu_worker/vision/qwen2vl_processor.py).
    image_processor = Qwen2VLImageProcessorPil(min_pixels=vision.min_pixels, max_pixels=vision.max_pixels,
                                               patch_size=vision.patch_size, merge_size=vision.merge)
    image_processor.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    return _publish(staging, out_dir)


def build_lora_adapter(base_dir: Path, out_dir: Path, spec: DemoAdapterSpec) -> Path:
    """Save a real PEFT LoRA adapter for `base_dir` with random A and B (seeded by spec.seed), and its task
    head if the spec has one (a classifier: PEFT's SEQ_CLS, on a text model). On a vision-language model it
    adapts the language model only, unless spec.tower: then the vision tower's linears of those names too."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification

    staging = _staging_dir(out_dir)
    targets: list[str] | str = list(spec.target_modules)
    classifier = spec.head is not None and spec.head.kind == "classifier"
    base_config = AutoConfig.from_pretrained(base_dir)
    if base_config.model_type in ("llava", "qwen2_vl"):  # vision-language models
        assert not classifier, "PEFT's SEQ_CLS heads are for text models"
        base = AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32)
        if not spec.tower:
            # A regex over module paths: bare names ("q_proj") would match the vision tower's projections too.
            targets = rf".*language_model.*\.({'|'.join(spec.target_modules)})"
    elif classifier:
        base = AutoModelForSequenceClassification.from_pretrained(base_dir, dtype=torch.float32,
                                                                  num_labels=len(spec.head.labels))
    else:
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(spec.seed)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=targets, use_rslora=spec.use_rslora,
                        rank_pattern=dict(spec.rank_pattern), alpha_pattern=dict(spec.alpha_pattern),
                        lora_dropout=0.0, bias="none", task_type="SEQ_CLS" if classifier else "CAUSAL_LM",
                        init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(LORA_B_GAIN)
            elif classifier and "score" in name:
                param.normal_(0.0, HEAD_INIT_STD / param.shape[1] ** 0.5)
    model.save_pretrained(staging, safe_serialization=True)
    if spec.head is not None:
        hidden = base_config.get_text_config().hidden_size
        add_head_files(staging, spec.head, hidden, spec.seed)
    return _publish(staging, out_dir)


def _complete(directory: Path, names: tuple[str, ...]) -> bool:
    return all((directory / name).is_file() for name in names)


def _base_or_build(name: str, base_dir: Path, files: tuple[str, ...], build: Callable[[], Path],
                   progress: Callable[[str], None]) -> None:
    if _complete(base_dir, files):
        progress(f"base model {name}: present at {base_dir}")
        return
    progress(f"base model {name}: building random weights ...")
    build()
    progress(f"base model {name}: written to {base_dir}")


def _adapters_or_build(base_dir: Path, adapters_dir: Path, specs: tuple[DemoAdapterSpec, ...],
                       progress: Callable[[str], None]) -> dict[str, Path]:
    adapter_dirs: dict[str, Path] = {}
    for index, spec in enumerate(specs, start=1):
        adapter_dir = adapters_dir / spec.name
        step = f"adapter {index}/{len(specs)} {spec.name} (rank {spec.rank})"
        if _complete(adapter_dir, ADAPTER_FILES):
            progress(f"{step}: present at {adapter_dir}")
        else:
            build_lora_adapter(base_dir, adapter_dir, spec)
            progress(f"{step}: written to {adapter_dir}")
        adapter_dirs[spec.name] = adapter_dir
    return adapter_dirs


def build_demo_assets(models_dir: Path, progress: Callable[[str], None] = print) -> list[DemoAssets]:
    """Build (or reuse) under `models_dir` the demo text model with DEMO_ADAPTERS (what the embedded
    default serves), then the demo LLaVA model with DEMO_VISION_ADAPTERS and the demo Qwen2-VL model
    with DEMO_QWEN2VL_ADAPTERS, both sharing its tokenizer; each also with its head adapters."""
    base_files = ("config.json", BASE_WEIGHTS_FILE, *TOKENIZER_FILES)
    text_dir, vision_dir = models_dir / DEMO_BASE_MODEL, models_dir / DEMO_VISION_BASE_MODEL
    qwen2vl_dir = models_dir / DEMO_QWEN2VL_BASE_MODEL
    _base_or_build(DEMO_BASE_MODEL, text_dir, base_files, lambda: build_llama(text_dir), progress)
    _base_or_build(DEMO_VISION_BASE_MODEL, vision_dir, base_files + PROCESSOR_FILES,
                   lambda: build_llava(vision_dir, tokenizer_dir=text_dir), progress)
    _base_or_build(DEMO_QWEN2VL_BASE_MODEL, qwen2vl_dir, base_files + IMAGE_PROCESSOR_FILES,
                   lambda: build_qwen2vl(qwen2vl_dir, tokenizer_dir=text_dir), progress)
    adapters_dir = models_dir / "adapters"
    return [DemoAssets(text_dir, _adapters_or_build(text_dir, adapters_dir, DEMO_ADAPTERS + DEMO_HEAD_ADAPTERS,
                                                    progress)),
            DemoAssets(vision_dir, _adapters_or_build(vision_dir, adapters_dir,
                                                      DEMO_VISION_ADAPTERS + DEMO_VISION_TOWER_ADAPTERS
                                                      + DEMO_VISION_HEAD_ADAPTERS, progress),
                       DEMO_VISION_BASE_MODEL),
            DemoAssets(qwen2vl_dir, _adapters_or_build(qwen2vl_dir, adapters_dir,
                                                       DEMO_QWEN2VL_ADAPTERS + DEMO_QWEN2VL_HEAD_ADAPTERS, progress),
                       DEMO_QWEN2VL_BASE_MODEL)]
