"""M-RoPE (Qwen2-VL): our per-prompt 3-D positions and rope delta equal transformers'
Qwen2VLModel.get_rope_index, and our cos/sin over them equal Qwen2VLRotaryEmbedding's."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2VLConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel, Qwen2VLRotaryEmbedding

from gpu_worker.layers.mrope import MRotaryEmbedding, rope_index

IMAGE = 7
MERGE = 2
CONFIG = Qwen2VLConfig(
    text_config=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                     intermediate_size=64, vocab_size=16,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
    vision_config=dict(depth=1, embed_dim=16, hidden_size=64, num_heads=2, spatial_merge_size=MERGE),
    image_token_id=IMAGE)


def _prompt(layout: list[int | tuple[int, int, int]]) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int, int]]]:
    """layout: text lengths and image grids (t, h, w) in order -> token ids, image runs, grids."""
    ids, runs, grids = [], [], []
    for part in layout:
        if isinstance(part, int):
            ids.extend([1] * part)
        else:
            t, h, w = part
            runs.append((len(ids), t * h * w // MERGE ** 2))
            ids.extend([IMAGE] * runs[-1][1])
            grids.append(part)
    return ids, runs, grids


@pytest.mark.parametrize("layout", [
    [5],
    [3, (1, 4, 6), 2],
    [1, (1, 6, 4), 4, (1, 2, 2), 3],
    [2, (2, 4, 4), 1],
])
def test_rope_index_matches_transformers(layout):
    ids, runs, grids = _prompt(layout)
    ours, delta = rope_index(len(ids), tuple(runs), grids, MERGE)
    input_ids = torch.tensor([ids])
    model = Qwen2VLModel.__new__(Qwen2VLModel)  # get_rope_index reads only the config
    model.config = CONFIG
    want, want_delta = Qwen2VLModel.get_rope_index(
        model, input_ids, (input_ids == IMAGE).int(), torch.tensor(grids) if grids else None)
    assert ours == want[:, 0].tolist()
    assert delta == int(want_delta)


def test_mrotary_matches_transformers():
    ids, runs, grids = _prompt([3, (1, 4, 6), 2])
    positions, _ = rope_index(len(ids), tuple(runs), grids, MERGE)
    positions = torch.tensor(positions)
    ours = MRotaryEmbedding(CONFIG.text_config, 16)
    ref = Qwen2VLRotaryEmbedding(CONFIG.text_config)
    cos, sin = ours(positions, torch.float32)
    want_cos, want_sin = ref(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=1e-6)
    # equal positions in all three: plain RoPE, what decode steps take as [num_tokens]
    flat = torch.arange(20, 30)
    torch.testing.assert_close(ours(flat, torch.float32)[0], ours(flat.expand(3, -1), torch.float32)[0])
