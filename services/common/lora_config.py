"""An adapter_config.json's LoRA hyper-parameters, as the registry checks them at import and the worker
at load: r and lora_alpha within bounds, rsLoRA, and the per-module rank_pattern and alpha_pattern,
resolved for a module exactly as PEFT resolves them (peft/tuners/lora/model.py `_create_and_replace`,
peft/utils/other.py `get_pattern_key`, peft/tuners/lora/layer.py `update_layer`):

    module "model.layers.1.self_attn.q_proj" (its tensors' name less "base_model.model.")
    rank_pattern {"layers.1.self_attn.q_proj": 12, "v_proj": 4}: the first key, in the file's order,
        with re.match(rf"(.*\\.)?({key})$", module) gives its r: 12; no key matches: r
    alpha_pattern likewise gives its alpha (default lora_alpha)
    scaling = alpha / sqrt(r) with use_rslora, alpha / r without

A key that matches no module is ignored, as PEFT does. Keys are regexes from an untrusted file: a key
that could backtrack for long (a repeated group, more than MAX_KEY_CHOICES choice points) is refused.
Options that change the math otherwise (DoRA and PEFT's other variants, ...) are refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from services.common.adapter_layout import CONFIG_FILE
from services.common.errors import InvalidArgument
from services.common.task_heads import allows_modules_to_save

# Bounds on the LoRA hyper-parameters we serve. Published recipes use r <= 256 and alpha <= 2 * r;
# past these an adapter_config.json is a typo or an attack (alpha 1e308 makes every output inf).
MAX_LORA_RANK = 1024
MAX_LORA_ALPHA = 4096.0
MAX_PATTERN_KEYS = 32     # per pattern; every key is matched against every adapted module
MAX_KEY_CHARS = 128
MAX_KEY_CHOICES = 4       # `* + ? {m,n} |` in one key: the matcher's work grows as (name length) ** this
# The smallest scaling (alpha / r, or alpha / sqrt(r)) served: float16's smallest normal number, 2**-14, the
# narrowest range of the dtypes a worker serves in (worker.dtype float16). Below it the scaled delta falls
# into float16's subnormals, losing its precision, or to zero: lora_alpha 1e-320 registered and served
# exactly the base model. Published recipes use alpha >= 1 and r <= 1024, a scaling of 2**-10 or more.
MIN_LORA_SCALING = 2.0 ** -14

# PEFT options that change the adapter's math; serving them as plain LoRA would give wrong outputs.
UNSUPPORTED_OPTIONS: dict[str, str] = {
    "modules_to_save": "modules_to_save (fully trained extra modules; a SEQ_CLS score head is served)",
    "use_dora": "use_dora (DoRA)",
    "layers_to_transform": "layers_to_transform (LoRA on a subset of layers)",
    "lora_bias": "lora_bias (a bias on lora_B)",
    "fan_in_fan_out": "fan_in_fan_out (transposed weights)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters",
    "use_qalora": "use_qalora (QA-LoRA)",
    "alora_invocation_tokens": "alora_invocation_tokens (activated LoRA)",
    "use_bdlora": "use_bdlora (block-diagonal LoRA)",
    "velora_config": "velora_config (VeLoRA)",
    "monteclora_config": "monteclora_config (MonteCLoRA)",
    "arrow_config": "arrow_config (Arrow routing)",
    "kasa_config": "kasa_config (KaSA)",
}

_Value = TypeVar("_Value", int, float)
_Pattern = tuple[tuple[re.Pattern[str], _Value], ...]  # (compiled key, value) in the file's order


def check_rank(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_LORA_RANK:
        raise InvalidArgument(f"{where}: r must be an integer from 1 to {MAX_LORA_RANK}, got {value!r}")
    return value


def check_alpha(value: object, where: str) -> float:
    # The chained comparison is False for NaN and +-inf too.
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= MAX_LORA_ALPHA:
        raise InvalidArgument(
            f"{where}: lora_alpha must be a finite number in (0, {MAX_LORA_ALPHA:g}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LoraHyperparameters:
    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: _Pattern[int] = ()
    alpha_pattern: _Pattern[float] = ()

    def rank_of(self, module: str) -> int:
        """`module`: its PEFT name, e.g. "model.layers.1.self_attn.q_proj"."""
        return _first_match(self.rank_pattern, module, self.r)

    def alpha_of(self, module: str) -> float:
        return _first_match(self.alpha_pattern, module, self.lora_alpha)

    def scaling_of(self, module: str) -> float:
        rank, alpha = self.rank_of(module), self.alpha_of(module)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def parse_lora_hyperparameters(config: Mapping[str, Any]) -> LoraHyperparameters:
    """The LoRA hyper-parameters of a parsed adapter_config.json; InvalidArgument on anything we cannot serve."""
    if config.get("peft_type") != "LORA":
        raise InvalidArgument(f"{CONFIG_FILE}: peft_type must be 'LORA', got {config.get('peft_type')!r}")
    rank = check_rank(config.get("r"), CONFIG_FILE)
    alpha = check_alpha(config.get("lora_alpha"), CONFIG_FILE)
    for key, description in UNSUPPORTED_OPTIONS.items():
        if key == "modules_to_save" and allows_modules_to_save(config):
            continue  # PEFT's SEQ_CLS head: served as a task head (services/common/task_heads.py)
        if config.get(key):
            raise InvalidArgument(f"{CONFIG_FILE}: {description} is not supported; Tessera serves LoRA "
                                  "(with rsLoRA, rank_pattern and alpha_pattern)")
    if config.get("bias", "none") != "none":
        raise InvalidArgument(f"{CONFIG_FILE}: bias={config['bias']!r} is not supported; only 'none'")
    use_rslora = config.get("use_rslora") or False
    if not isinstance(use_rslora, bool):
        raise InvalidArgument(f"{CONFIG_FILE}: use_rslora must be true or false, got {use_rslora!r}")
    hyperparameters = LoraHyperparameters(rank, alpha, use_rslora,
                                          _parse_pattern(config.get("rank_pattern"), "rank_pattern", check_rank),
                                          _parse_pattern(config.get("alpha_pattern"), "alpha_pattern", check_alpha))
    _check_smallest_scaling(hyperparameters)
    return hyperparameters


def _check_smallest_scaling(hyperparameters: LoraHyperparameters) -> None:
    """InvalidArgument if some module's scaling may fall under MIN_LORA_SCALING: the smallest alpha over the
    largest rank (of lora_alpha, r and every pattern value) bounds every module's scaling from below."""
    alpha = min([hyperparameters.lora_alpha, *(value for _, value in hyperparameters.alpha_pattern)])
    rank = max([hyperparameters.r, *(value for _, value in hyperparameters.rank_pattern)])
    scaling = alpha / math.sqrt(rank) if hyperparameters.use_rslora else alpha / rank
    if scaling < MIN_LORA_SCALING:
        rule = "alpha / sqrt(r) (rsLoRA)" if hyperparameters.use_rslora else "alpha / r"
        raise InvalidArgument(
            f"{CONFIG_FILE}: lora_alpha {alpha:.3g} at r={rank} scales the adapter's delta by {scaling:.3g} "
            f"({rule}), under {MIN_LORA_SCALING:.3g}, float16's smallest normal number: the delta would lose "
            "its precision or vanish in the serving dtype, and the adapter would serve the base model's "
            "outputs; raise lora_alpha")


def _first_match(pattern: _Pattern[_Value], module: str, default: _Value) -> _Value:
    return next((value for key, value in pattern if key.match(module)), default)


def _parse_pattern(value: object, name: str, check: Callable[[object, str], _Value]) -> _Pattern[_Value]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidArgument(f"{CONFIG_FILE}: {name} must map module names or regexes to values, got {value!r}")
    if len(value) > MAX_PATTERN_KEYS:
        raise InvalidArgument(f"{CONFIG_FILE}: {name} has {len(value)} keys; at most {MAX_PATTERN_KEYS} are served")
    return tuple((_compile_key(key, name), check(v, f"{CONFIG_FILE} {name}[{key!r}]")) for key, v in value.items())


def _compile_key(key: str, name: str) -> re.Pattern[str]:
    where = f"{CONFIG_FILE}: {name} key {key[:MAX_KEY_CHARS]!r}"
    if not 1 <= len(key) <= MAX_KEY_CHARS:
        raise InvalidArgument(f"{where} must have 1 to {MAX_KEY_CHARS} characters")
    _refuse_backtracking(key, where)
    try:
        return re.compile(rf"(.*\.)?({key})$")  # PEFT's get_pattern_key, with re.match
    except re.error as exc:
        raise InvalidArgument(f"{where} is not a valid regex: {exc}") from None


def _refuse_backtracking(key: str, where: str) -> None:
    """A repeated group ("(a+)+", "(x|y)*") can take exponential time, and every `* + ? {m,n} |` multiplies
    the matcher's work: InvalidArgument past MAX_KEY_CHOICES, or on a quantified group. Escapes and
    character classes hold literals; `?` opening a group's extension or making a quantifier lazy is no choice."""
    choices, previous, in_class, escaped = 0, "", False, False
    for char in key:
        if escaped:
            escaped, previous = False, "\\x"
            continue
        if char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char in "*+?{":
            if previous == ")":
                raise InvalidArgument(f"{where} repeats a group, which may backtrack for exponential time; "
                                      "list the modules as separate keys")
            if not (char == "?" and previous in ("(", "*", "+", "?", "}")):
                choices += 1
        elif char == "|":
            choices += 1
        previous = char
    if choices > MAX_KEY_CHOICES:
        raise InvalidArgument(f"{where} has {choices} of `* + ? {{ |`; at most {MAX_KEY_CHOICES} are served "
                              "(each multiplies the matching work)")
