"""Our Llama-family decoder for serving (Llama, Mistral, Qwen2 configs), over packed tokens.

The module tree mirrors the Hugging Face checkpoint names (model.layers.{i}.self_attn.q_proj, ...),
so every checkpoint tensor maps to exactly one parameter by name; the loader insists on an exact
match (no substring matching), except that q/k/v and gate/up are fused into one projection each
(one matmul instead of three or two); their checkpoint tensors land in slices of the fused weight.
The projections adapters may target are LoRALinear modules.

forward() takes the packed new tokens of every sequence in the step (no padding); attention and
LoRA read the per-step layout from the forward context. A vision-language model's language model is
this one too: its prefill gets input embeddings with image features in place of image tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from gpu_worker.forward_context import get_forward_context
from gpu_worker.layers.mrope import MRotaryEmbedding
from gpu_worker.layers.norm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.lora.layer import LoRALinear
import kernels
from kernels import paged_attention, rotary_store_kv, silu_and_mul

# PEFT target-module name -> path of that projection inside a Hugging Face decoder layer (the
# names in checkpoints and in PEFT adapter files).
LORA_TARGETS: dict[str, str] = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
# Hugging Face projection path -> (our fused projection's path, output slice).
FUSED_PATHS: dict[str, tuple[str, int]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0),
}


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the families this file serves (data, not subclasses)."""
    qkv_bias: bool
    o_bias: bool


def arch_spec(config: PretrainedConfig) -> ArchSpec:
    if config.model_type in ("qwen2", "qwen2_vl_text"):  # qwen2_vl_text: Qwen2-VL's language model
        return ArchSpec(qkv_bias=True, o_bias=False)
    if config.model_type in ("llama", "mistral"):
        bias = bool(getattr(config, "attention_bias", False))
        return ArchSpec(qkv_bias=bias, o_bias=bias)
    raise ValueError(f"unsupported model_type {config.model_type!r} (llama, mistral, qwen2)")


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, spec: ArchSpec) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        hidden, self.q_size, self.kv_size = (config.hidden_size, self.num_heads * self.head_dim,
                                             self.num_kv_heads * self.head_dim)
        self.qkv_proj = LoRALinear(hidden, (self.q_size, self.kv_size, self.kv_size), bias=spec.qkv_bias)
        self.o_proj = LoRALinear(self.q_size, (hidden,), bias=spec.o_bias)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden]; cos, sin: [num_tokens, head_dim] -> [num_tokens, hidden]."""
        context = get_forward_context()
        k_cache, v_cache = context.kv_cache.layer(self.layer)
        # One launch: rotary on q and k, and this step's K/V into the cache.
        q = rotary_store_kv(self.qkv_proj(x), cos, sin, k_cache, v_cache, context.attention.slot_mapping,
                            self.num_heads, self.num_kv_heads, self.head_dim)  # [num_tokens, heads, head_dim]
        attended = paged_attention(q, k_cache, v_cache, context.attention, self.scale)
        return self.o_proj(attended.reshape(x.shape[0], self.q_size))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        assert config.hidden_act == "silu", config.hidden_act
        hidden, self.inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = LoRALinear(hidden, (self.inter, self.inter), bias=False)
        self.down_proj = LoRALinear(self.inter, (hidden,), bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, spec: ArchSpec) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, spec)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream travels beside the sublayer output so that each residual add fuses
        into the next norm: the layer's hidden state is x + residual. residual is None on the first
        layer, whose x is the embedding. Returns (mlp output, residual), both [num_tokens, hidden]."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin), residual)
        return self.mlp(x), residual


class DecoderStack(nn.Module):
    """`model.*` in the checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: PretrainedConfig, spec: ArchSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, spec) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Qwen2-VL's language model rotates by 3-D positions (layers/mrope.py); every other family by 1-D.
        rotary = MRotaryEmbedding if "mrope_section" in config.rope_parameters else RotaryEmbedding
        self.rotary = rotary(config, _head_dim(config))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: the token embeddings [num_tokens, hidden]; positions: [num_tokens], or [3, num_tokens]
        under M-RoPE."""
        cos, sin = self.rotary(positions, x.dtype)  # [num_tokens, head_dim] each, shared by every layer
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin)
        x, _ = self.norm(x, residual)  # the last layer's residual add fused into the final norm
        return x


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config, arch_spec(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)

    @property
    def max_context(self) -> int:
        """Longest sequence served. A sliding attention window (Mistral v0.1, Qwen2 when enabled)
        caps it: no token then ever sees past the window, so full attention computes the same."""
        window = getattr(self.config, "sliding_window", None)
        if not getattr(self.config, "use_sliding_window", True):
            window = None
        return min(self.config.max_position_embeddings, window or self.config.max_position_embeddings)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> token embeddings [num_tokens, hidden]."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: [num_tokens], positions: [num_tokens] (or [3, num_tokens] under M-RoPE) -> hidden
        states [num_tokens, hidden]. inputs_embeds [num_tokens, hidden], when given, replaces
        embed(input_ids) (image features merged in)."""
        return self.model(self.embed(input_ids) if inputs_embeds is None else inputs_embeds, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_seqs, hidden] (last token of each sequence) -> float32 [num_seqs, vocab]."""
        return kernels.linear(hidden, self.lm_head.weight).float()

    def lora_layers(self, targets: Iterable[str]) -> dict[tuple[int, str], tuple[LoRALinear, int]]:
        """(layer index, PEFT target name) -> the LoRALinear serving it and its output slice."""
        unknown = sorted(set(targets) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(f"unknown LoRA targets {unknown}; known: {sorted(LORA_TARGETS)}")
        served = {}
        for i, layer in enumerate(self.model.layers):
            for target in targets:
                path, out_slice = FUSED_PATHS[LORA_TARGETS[target]]
                served[(i, target)] = (layer.get_submodule(path), out_slice)
        return served

    def init_lora_slots(self, num_slots: int, max_rank: int, targets: Iterable[str],
                        arena: kernels.AdapterArena) -> None:
        """Give the projections serving `targets` their adapter slots, all in `arena`."""
        for module in {id(m): m for m, _ in self.lora_layers(targets).values()}.values():
            module.init_slots(num_slots, max_rank, arena)

    def lora_adapter_elems(self, max_rank: int, targets: Iterable[str]) -> int:
        """Arena elements the largest servable adapter takes: rank max_rank on every slice serving `targets`."""
        served: dict[int, tuple[LoRALinear, set[int]]] = {}
        for module, out_slice in self.lora_layers(targets).values():
            served.setdefault(id(module), (module, set()))[1].add(out_slice)
        return sum(module.slot_elems([max_rank if s in slices else 0 for s in range(len(module.out_sizes))])
                   for module, slices in served.values())

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Copy checkpoint tensors (Hugging Face names) in; every parameter must be covered exactly."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in tensors:
            param_name, rows = self._param_rows(name)
            if param_name not in params:
                raise ValueError(f"{source}: tensor {name!r} has no parameter in {type(self).__name__}")
            target = params[param_name].data[rows]
            if target.shape != tensor.shape:
                raise ValueError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            seen.add(name)
        if self.config.tie_word_embeddings and "lm_head.weight" not in seen:
            self.lm_head.weight = self.model.embed_tokens.weight
            seen.add("lm_head.weight")
        expected = {hf for name, param in self.named_parameters() for hf in self._checkpoint_names(name)}
        missing = sorted(expected - seen)
        if missing:
            raise ValueError(f"{source} lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def _param_rows(self, name: str) -> tuple[str, slice]:
        """Checkpoint tensor name -> (our parameter, its rows that hold the tensor)."""
        for hf_path, (path, out_slice) in FUSED_PATHS.items():
            marker = f".{hf_path}."
            if marker in name:
                prefix, kind = name.split(marker)
                module = self.get_submodule(f"{prefix}.{path}")
                offsets = module.out_offsets
                return f"{prefix}.{path}.{kind}", slice(offsets[out_slice], offsets[out_slice + 1])
        return name, slice(None)

    def _checkpoint_names(self, param_name: str) -> list[str]:
        """Our parameter -> the checkpoint tensors that fill it."""
        for path in {path for path, _ in FUSED_PATHS.values()}:
            marker = f".{path}."
            if marker in param_name:
                prefix, kind = param_name.split(marker)
                return [f"{prefix}.{hf}.{kind}" for hf, (p, _) in FUSED_PATHS.items() if p == path]
        return [param_name]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': float32 on CPU, bfloat16 on CUDA; otherwise a torch dtype name ('float16')."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, name, None)
    assert isinstance(dtype, torch.dtype), f"unknown dtype {name!r}"
    return dtype


def build_model(config: PretrainedConfig, tensors: Iterable[tuple[str, torch.Tensor]], source: str, *,
                device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """The model of `config` with `tensors` (Hugging Face names of a causal LM) as its weights."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    model.load_weights(tensors, source)
    return model.to(device=device, dtype=dtype).eval()

