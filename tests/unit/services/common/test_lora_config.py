"""adapter_config.json's hyper-parameters: per-module ranks and alphas resolved as PEFT resolves them,
bounds, and pattern keys that could make the matcher backtrack for long refused."""

from __future__ import annotations

import math
import time

import pytest
from peft.utils.other import get_pattern_key

from services.common.errors import InvalidArgument
from services.common.lora_config import MAX_PATTERN_KEYS, parse_lora_hyperparameters

MODULES = [f"model{lm}.layers.{layer}.{block}.{proj}"
           for lm in ("", ".language_model") for layer in (0, 1, 11)
           for block, proj in (("self_attn", "q_proj"), ("self_attn", "v_proj"), ("mlp", "down_proj"))]
KEYS = ["q_proj", "layers.1.self_attn.q_proj", r"layers\.1\d?\..*", "v_proj", "model.layers.0.mlp.down_proj",
        "^model.layers.11.self_attn.q_proj", "proj", ".*_proj", "language_model.*", "(q|v)_proj", "self_attn"]


def _config(**fields: object) -> dict[str, object]:
    return {"peft_type": "LORA", "r": 8, "lora_alpha": 16, **fields}


@pytest.mark.parametrize("order", range(4))
def test_ranks_and_alphas_resolve_as_peft_resolves_them(order):
    """PEFT's get_pattern_key over the same keys, in several orders: the first matching key wins."""
    keys = KEYS[order:] + KEYS[:order] if order % 2 else list(reversed(KEYS[order:] + KEYS[:order]))
    rank_pattern = {key: 2 + i for i, key in enumerate(keys)}
    alpha_pattern = {key: 0.5 + 3 * i for i, key in enumerate(reversed(keys))}
    for use_rslora in (False, True):
        parsed = parse_lora_hyperparameters(_config(rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
                                                    use_rslora=use_rslora))
        for module in MODULES:
            rank = rank_pattern.get(get_pattern_key(rank_pattern.keys(), module), 8)
            alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), module), 16)
            assert (parsed.rank_of(module), parsed.alpha_of(module)) == (rank, alpha), module
            want = alpha / math.sqrt(rank) if use_rslora else alpha / rank
            assert parsed.scaling_of(module) == want, module


@pytest.mark.parametrize("fields, message", [
    ({"rank_pattern": {"q_proj": 0}}, "rank_pattern['q_proj']: r must be an integer from 1 to 1024, got 0"),
    ({"rank_pattern": {"q_proj": 2048}}, "got 2048"),
    ({"rank_pattern": {"q_proj": 4.0}}, "got 4.0"),
    ({"alpha_pattern": {"q_proj": 1e308}}, "alpha_pattern['q_proj']: lora_alpha must be a finite number"),
    ({"alpha_pattern": {"q_proj": -1}}, "got -1"),
    ({"rank_pattern": ["q_proj", 4]}, "rank_pattern must map module names or regexes to values"),
    ({"rank_pattern": {"(q_proj": 4}}, "is not a valid regex"),
    ({"rank_pattern": {"": 4}}, "must have 1 to 128 characters"),
    ({"rank_pattern": {f"k{i}": 4 for i in range(MAX_PATTERN_KEYS + 1)}}, f"at most {MAX_PATTERN_KEYS} are served"),
    ({"alpha_pattern": {"(.*)*X": 4}}, "repeats a group"),
    ({"alpha_pattern": {"(?:a|b){2,}": 4}}, "repeats a group"),
    ({"rank_pattern": {".*.*.*.*.*X": 4}}, "has 5 of"),
    ({"rank_pattern": {"(a|b|c|d|e|f)_proj": 4}}, "has 5 of `* + ? { |`; at most 4 are served"),
    ({"use_rslora": "yes"}, "use_rslora must be true or false"),
    ({"use_dora": True}, "use_dora (DoRA) is not supported"),
    ({"use_bdlora": {"nblocks": 2}}, "use_bdlora (block-diagonal LoRA) is not supported"),
    ({"alora_invocation_tokens": [1, 2]}, "activated LoRA"),
])
def test_unservable_options_are_refused(fields, message):
    with pytest.raises(InvalidArgument) as error:
        parse_lora_hyperparameters(_config(**fields))
    assert message in error.value.message


def test_accepted_keys_match_quickly_on_long_module_names():
    """The worst keys the backtracking guard lets through, on a 70-character module name."""
    module = "model.language_model.layers.31.self_attn." + "x" * 29
    for key in (".*.*.*.*", r".*\d+.*.*", "(a|.)(b|.)(c|.)(d|.)", ".?.?.?.?"):
        parsed = parse_lora_hyperparameters(_config(rank_pattern={key + "Z": 4}))
        start = time.perf_counter()
        assert parsed.rank_of(module) == 8
        assert time.perf_counter() - start < 0.5, key  # about 7 ms for the first; a repeated group: hours
