"""The reference LoRA ops against a naive per-token float64 loop."""

from __future__ import annotations

import pytest
import torch

from kernels import NO_SLOT, LoRABatchInfo, lora_expand, lora_shrink

IN, OUT = 24, 20
RANKS = (8, 16, 4, 64)  # mixed ranks, one per slot


def _naive(x, out, lora_a, lora_b, scalings, batch):
    """out + scaling * B A x, token by token, in float64."""
    expected = out.double().clone()
    for start, length, slot in zip(batch.seg_starts, batch.seg_lens, batch.seg_slots):
        for t in range(start, start + length):
            if slot == NO_SLOT or lora_a[slot] is None:
                continue
            a, b = lora_a[slot].double(), lora_b[slot].double()
            expected[t] += scalings[slot] * (b @ (a @ x[t].double()))
    return expected


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    lora_a = [torch.randn(r, IN, generator=g) for r in RANKS]
    lora_b = [torch.randn(OUT, r, generator=g) for r in RANKS]
    lora_a[2] = lora_b[2] = None  # slot 2: adapter that does not target this projection
    scalings = [2.0, 0.5, 1.0, 1.0]
    return lora_a, lora_b, scalings


CASES = {
    "mixed": ((0, 5, 6, 9, 10), (5, 1, 3, 1, 4), (0, NO_SLOT, 3, 1, 0)),
    "empty_segments": ((0, 3, 3, 7), (3, 0, 4, 0), (1, 0, 3, 3)),
    "single_tokens": ((0, 1, 2, 3), (1, 1, 1, 1), (3, 0, 1, NO_SLOT)),
    "untargeted_slot": ((0, 4), (4, 3), (2, 1)),
    "no_adapter": ((0,), (7,), (NO_SLOT,)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shrink_expand_match_naive_loop(case, dtype):
    starts, lens, slots = CASES[case]
    num_tokens = starts[-1] + lens[-1]
    used = [RANKS[s] for s, n in zip(slots, lens) if s != NO_SLOT and n > 0]
    batch = LoRABatchInfo(num_tokens, starts, lens, slots, max(used, default=0))
    lora_a, lora_b, scalings = _weights(seed=len(case))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, IN, generator=g).to(dtype)
    out = torch.randn(num_tokens, OUT, generator=g).to(dtype)
    expected = _naive(x, out, lora_a, lora_b, scalings, batch)

    y = lora_shrink(x, lora_a, scalings, batch)
    assert y.dtype == torch.float32 and y.shape == (num_tokens, batch.max_rank)
    lora_expand(out, y, lora_b, batch)

    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_no_lora_exits_early_and_leaves_output_untouched():
    batch = LoRABatchInfo.no_lora(3)
    assert not batch.has_lora
    out = torch.ones(3, OUT)
    y = lora_shrink(torch.randn(3, IN), [None], [1.0], batch)
    assert y.shape == (3, 0)
    lora_expand(out, y, [None], batch)
    assert torch.equal(out, torch.ones(3, OUT))


def test_shape_mismatch_is_rejected():
    batch = LoRABatchInfo(2, (0,), (2,), (0,), 4)
    with pytest.raises(AssertionError):
        lora_shrink(torch.randn(3, IN), [torch.randn(4, IN)], [1.0], batch)
    with pytest.raises(AssertionError):
        LoRABatchInfo(2, (0,), (3,), (0,), 4)  # segment runs past the batch
