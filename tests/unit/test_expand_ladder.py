"""benchmarks/expand_ladder.py on CPU: its probe kernel in Triton's interpreter (tests/conftest.py),
against torch, and the fixed + per-token fit it reports."""

from __future__ import annotations

import torch

from benchmarks import expand_ladder as el


def test_product_rung_adds_y_times_b():
    el.check_product("cpu", torch.float16, tokens=32, hidden=512, rank=16)


def test_rmw_rung_adds_one_to_every_element():
    out = torch.randn(32, 512).to(torch.float16)
    want = out.float() + 1
    el.ladder_rung(out, torch.zeros(32, 16), torch.zeros(16, 512, dtype=torch.float16), False, el.RUNG_CONFIG)
    torch.testing.assert_close(out.float(), want, rtol=1e-3, atol=1e-2)


def test_fit_recovers_fixed_and_per_token_cost():
    tokens = [512, 2048, 4096, 8192]
    fixed, per_token = el.fit(tokens, [3e-6 + 4e-9 * t for t in tokens])
    assert abs(fixed - 3e-6) < 1e-9 and abs(per_token - 4e-9) < 1e-12


def test_min_bytes_counts_out_twice_and_y_and_b_once():
    assert el.min_bytes(10, 100, 8) == 2 * (2 * 10 * 100 + 10 * 8 + 8 * 100)
