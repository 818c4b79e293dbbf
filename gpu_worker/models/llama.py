"""Our Llama-family decoder for serving (Llama, Mistral, Qwen2 configs), over packed tokens.

The module tree mirrors the Hugging Face checkpoint names (model.layers.{i}.self_attn.q_proj, ...),
so every checkpoint tensor maps to exactly one parameter by name; the loader insists on an exact
match (no substring matching). The projections adapters may target are LoRALinear modules.

forward() takes the packed new tokens of every sequence in the step (no padding); attention and
LoRA read the per-step layout from the forward context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from gpu_worker.forward_context import get_forward_context
from gpu_worker.layers.norm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding, apply_rotary
from gpu_worker.lora.layer import LoRALinear

# PEFT target-module name -> path of that projection inside a decoder layer.
LORA_TARGETS: dict[str, str] = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the families this file serves (data, not subclasses)."""
    qkv_bias: bool
    o_bias: bool


def arch_spec(config: PretrainedConfig) -> ArchSpec:
    if config.model_type == "qwen2":
        return ArchSpec(qkv_bias=True, o_bias=False)
    if config.model_type in ("llama", "mistral"):
        bias = bool(getattr(config, "attention_bias", False))
        return ArchSpec(qkv_bias=bias, o_bias=bias)
    raise ValueError(f"unsupported model_type {config.model_type!r} (llama, mistral, qwen2)")


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, spec: ArchSpec, num_slots: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = LoRALinear(hidden, q_size, bias=spec.qkv_bias, num_slots=num_slots)
        self.k_proj = LoRALinear(hidden, kv_size, bias=spec.qkv_bias, num_slots=num_slots)
        self.v_proj = LoRALinear(hidden, kv_size, bias=spec.qkv_bias, num_slots=num_slots)
        self.o_proj = LoRALinear(q_size, hidden, bias=spec.o_bias, num_slots=num_slots)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden] -> [num_tokens, hidden]."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        context = get_forward_context()
        attended = context.kv_cache.attend(self.layer, q, k, v, context.seqs, self.scale)
        return self.o_proj(attended.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, num_slots: int) -> None:
        super().__init__()
        assert config.hidden_act == "silu", config.hidden_act
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = LoRALinear(hidden, inter, bias=False, num_slots=num_slots)
        self.up_proj = LoRALinear(hidden, inter, bias=False, num_slots=num_slots)
        self.down_proj = LoRALinear(inter, hidden, bias=False, num_slots=num_slots)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, spec: ArchSpec, num_slots: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, spec, num_slots)
        self.mlp = MLP(config, num_slots)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """`model.*` in the checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: PretrainedConfig, spec: ArchSpec, num_slots: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, spec, num_slots) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, _head_dim(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig, num_slots: int) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config, arch_spec(config), num_slots)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_seqs, hidden] (last token of each sequence) -> float32 [num_seqs, vocab]."""
        return self.lm_head(hidden).float()

    def lora_layers(self) -> dict[tuple[int, str], LoRALinear]:
        """(layer index, PEFT target name) -> the LoRALinear serving it."""
        return {(i, target): layer.get_submodule(path)
                for i, layer in enumerate(self.model.layers) for target, path in LORA_TARGETS.items()}

    def load_weights(self, checkpoint_dir: Path) -> None:
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in _iter_checkpoint(checkpoint_dir):
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            assert params[name].shape == tensor.shape, (name, params[name].shape, tensor.shape)
            params[name].data.copy_(tensor)
            seen.add(name)
        if self.config.tie_word_embeddings and "lm_head.weight" not in seen:
            self.lm_head.weight = self.model.embed_tokens.weight
            seen.add("lm_head.weight")
        missing = sorted(set(params) - seen)
        if missing:
            raise ValueError(f"checkpoint {checkpoint_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _iter_checkpoint(checkpoint_dir: Path):
    """(name, tensor) over model.safetensors or the shards listed in model.safetensors.index.json."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (checkpoint_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no safetensors weights in {checkpoint_dir}")
    for file in files:
        with safe_open(checkpoint_dir / file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': float32 on CPU, bfloat16 on CUDA; otherwise a torch dtype name ('float16')."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, name, None)
    assert isinstance(dtype, torch.dtype), f"unknown dtype {name!r}"
    return dtype


def load_model(checkpoint_dir: Path, *, device: torch.device, dtype: torch.dtype, num_slots: int) -> LlamaForCausalLM:
    config = AutoConfig.from_pretrained(checkpoint_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, num_slots)
    model = model.to_empty(device="cpu")
    model.load_weights(checkpoint_dir)
    return model.to(device=device, dtype=dtype).eval()
