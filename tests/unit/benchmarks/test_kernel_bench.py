"""benchmarks/kernel_bench.py on CPU: case generation, the bytes model, the correctness gate, and the
measure/summary plumbing with a fake timer (the ATMM kernels run in Triton's interpreter, see
tests/conftest.py). The implementations it runs: test_lora_impls.py; its whole flow: test_smoke.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from benchmarks import kernel_bench as kb
from benchmarks.harness import lora_cases
from benchmarks.harness import lora_impls as impls
from benchmarks.harness.report import write_json
from kernels import tiling

F32 = torch.float32


def small_case(ranks: str = "mixed", adapters: int = 4, tokens: int = 12, layout: str = "prefill",
               hidden: int = 48) -> lora_cases.Case:
    return lora_cases.make_case(hidden, ranks, adapters, tokens, layout)


# ---- cases ---------------------------------------------------------------------------------

@pytest.mark.parametrize("adapters,tokens", [(1, 8), (4, 8), (4, 2), (16, 128), (64, 32)])
def test_decode_case_is_one_token_per_request_round_robin_and_shuffled(adapters, tokens):
    case = lora_cases.make_case(4096, "u16", adapters, tokens, "decode")
    assert case.seg_lens == (1,) * tokens and case.tokens == tokens
    # Request i uses adapter i % n: adapter counts as in round robin.
    assert Counter(case.seg_adapters) == Counter(i % adapters for i in range(tokens))
    assert case == lora_cases.make_case(4096, "u16", adapters, tokens, "decode")  # seeded: repeatable
    if tokens >= 32 and adapters > 1:
        assert list(case.seg_adapters) != [i % adapters for i in range(tokens)]


@pytest.mark.parametrize("adapters,tokens", [(1, 2048), (4, 8), (4, 5), (16, 2048), (64, 512), (16, 8)])
def test_prefill_case_splits_tokens_over_interleaved_requests(adapters, tokens):
    case = lora_cases.make_case(3584, "mixed", adapters, tokens, "prefill")
    requests = min(tokens, 2 * adapters)
    assert len(case.seg_lens) == requests and all(n >= 1 for n in case.seg_lens) and case.tokens == tokens
    assert Counter(case.seg_adapters) == Counter(i % adapters for i in range(requests))
    if adapters > 1:  # one adapter's requests are never adjacent: its tokens are not contiguous
        assert all(a != b for a, b in zip(case.seg_adapters, case.seg_adapters[1:]))
    assert case == lora_cases.make_case(3584, "mixed", adapters, tokens, "prefill")
    # The same requests at every hidden size and rank set.
    other = lora_cases.make_case(4096, "u16", adapters, tokens, "prefill")
    assert (other.seg_lens, other.seg_adapters) == (case.seg_lens, case.seg_adapters)


def test_grid_leaves_out_one_token_prefill_and_covers_the_rest():
    cases = lora_cases.make_cases([4096, 3584], list(lora_cases.RANK_SETS), [1, 4, 16, 64], [1, 8, 32, 128, 512, 2048, 8192],
                          ["decode", "prefill"])
    assert len(cases) == 2 * 3 * 4 * (7 + 6)
    assert not [c for c in cases if c.layout == "prefill" and c.tokens == 1]
    assert len({c.name for c in cases}) == len(cases)


def test_ranks_and_scalings_per_adapter():
    case = small_case("mixed", adapters=7)
    assert case.adapter_ranks == (8, 16, 32, 64, 128, 8, 16) and case.max_rank == 128
    assert small_case("u64", adapters=3).adapter_ranks == (64, 64, 64)
    assert len(set(case.adapter_scalings[:4])) == 4


def test_used_ranks_count_only_adapters_some_token_uses():
    case = lora_cases.make_case(64, "mixed", 64, 1, "decode")  # one token: one of the 64 adapters
    assert case.used_ranks() == [8]


# ---- bytes model ---------------------------------------------------------------------------

def test_min_bytes_by_hand():
    # Requests (3 tokens, adapter 0 of rank 8), (1, adapter 2 of rank 32); adapter 1 unused.
    case = lora_cases.Case(hidden=100, ranks="mixed", adapters=3, layout="prefill", seg_lens=(3, 1), seg_adapters=(0, 2))
    assert case.token_ranks() == [8, 8, 8, 32] and case.used_ranks() == [8, 32]
    weights = (8 + 32) * 100 * 2
    y = (3 * 8 + 32) * 2
    assert lora_cases.min_bytes("shrink", case) == 4 * 100 * 2 + weights + y
    assert lora_cases.min_bytes("expand", case) == 2 * 4 * 100 * 2 + weights + y


# ---- inputs --------------------------------------------------------------------------------

def test_random_stack_packs_copies_at_their_true_ranks_like_set_slot():
    case = small_case("mixed", adapters=3)
    stack = lora_cases.random_stack(case, 2, F32, "cpu", torch.Generator().manual_seed(0))
    assert stack.num_slots == 6 and stack.max_rank == 128 and stack.out_offsets == (0, 48)
    assert stack.host_ranks == [[8], [16], [32], [8], [16], [32]]
    assert stack.ranks[:, 0].tolist() == [8, 16, 32, 8, 16, 32]
    assert stack.scalings[:, 0].tolist() == list(case.adapter_scalings) * 2
    assert stack.a_offsets.tolist() == stack.host_a_offsets and stack.b_offsets.tolist() == stack.host_b_offsets
    # No padding: the arena is exactly the slots' packed sizes, every range its own.
    assert stack.arena.capacity == stack.arena.used_elems == sum(stack.slot_elems(r) for r in stack.host_ranks)
    ranges = sorted((a, b + rank * 48) for (a,), (b,), (rank,) in
                    zip(stack.host_a_offsets, stack.host_b_offsets, stack.host_ranks))
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:]))
    for slot, (rank,) in enumerate(stack.host_ranks):  # fresh weights of the slot's rank, of the documented scale
        a, b = stack.a_weight(slot, 0), stack.b_weight(slot, 0)
        assert a.shape == b.shape == (rank, 48) and a.abs().min() > 0 and b.abs().min() > 0
        assert 0.5 < a.std().item() * 48 ** 0.5 < 2 and 0.5 < b.std().item() * rank ** 0.5 < 2
    batch = lora_cases.copy_batch(case, 1, "cpu")
    assert batch.seg_slots == tuple(3 + j for j in case.seg_adapters)


def test_only_used_adapters_get_slots():
    case = lora_cases.make_case(32, "mixed", 16, 3, "decode")  # 3 tokens: 3 of the 16 adapters
    used = case.used_adapters()
    assert len(used) == 3
    stack = lora_cases.random_stack(case, 4, F32, "cpu", torch.Generator().manual_seed(0))
    assert stack.num_slots == 12
    assert stack.host_ranks == [[case.adapter_ranks[j]] for j in used] * 4
    batch = lora_cases.copy_batch(case, 2, "cpu")
    assert batch.seg_slots == tuple(6 + used.index(j) for j in case.seg_adapters)


# ---- check and measure ---------------------------------------------------------------------

def test_check_case_passes_every_implementation():
    kb.check_case(small_case("mixed", 4, 12, "prefill", hidden=40), impls.IMPLS, "cpu", F32)
    kb.check_case(small_case("u16", 3, 6, "decode", hidden=40), impls.IMPLS, "cpu", F32)


class _WrongScaling(impls.TorchLoop):
    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        return super().shrink(x) * 1.1


class _DropsOneToken(impls.GatherBmm):
    def expand(self, out: torch.Tensor, y: torch.Tensor) -> None:
        y = y.clone()
        y[self.rows[-1]] = 0
        super().expand(out, y)


@pytest.mark.parametrize("impl,op", [(_WrongScaling, "shrink"), (_DropsOneToken, "expand")])
def test_check_case_rejects_a_wrong_implementation(impl, op):
    case = small_case("u16", 4, 12, "prefill", hidden=32)
    with pytest.raises(kb.Mismatch, match=f"broken {op} on {case.name}"):
        kb.check_case(case, {"torch_loop": impls.TorchLoop, "broken": impl}, "cpu", F32)


def test_measure_case_times_every_impl_and_op_over_rotating_copies():
    case = small_case("mixed", 3, 8, "decode", hidden=32)
    timed: list[int] = []

    def fake_timer(calls):  # runs each copy's call once, as graph_time_s's warm-up does
        for call in calls:
            call()
        timed.append(len(calls))
        return 1e-6 * len(timed)

    rows = kb.measure_case(case, impls.IMPLS, "cpu", F32, copies=3, timer=fake_timer)
    assert timed == [3] * 2 * len(impls.IMPLS)
    assert [r.op for r in rows] == list(kb.OPS) and all(r.copies == 3 for r in rows)
    assert list(rows[0].seconds) == list(impls.IMPLS)
    assert rows[0].seconds["atmm_tuned"] == 1e-6 and rows[1].seconds["atmm_tuned"] == 2e-6
    assert rows[0].bytes == lora_cases.min_bytes("shrink", case) and rows[1].bytes == lora_cases.min_bytes("expand", case)
    assert set(rows[0].tuned_config) == set(tiling.ShrinkConfig.__dataclass_fields__)


# ---- summary and report --------------------------------------------------------------------

def _row(tokens: int, op: str, tuned: float, static: float, loop: float, bmm: float, differ: bool = True) -> kb.Row:
    case = lora_cases.make_case(4096, "u16", 4, tokens, "decode")
    return kb.Row(case, op, bytes=1000, copies=1,
                  seconds={"atmm_tuned": tuned, "atmm_static": static, "torch_loop": loop, "gather_bmm": bmm},
                  tuned_config={"block_m": 16}, static_config={"block_m": 64 if differ else 16})


def test_summary_targets_pass_and_miss():
    bandwidth = 1e9  # 1000 bytes: 1 µs at roofline
    rows = [
        _row(8, "shrink", 3e-6, 6e-6, 10e-6, 10e-6),                # static / tuned 2
        _row(32, "shrink", 4.5e-6, 4.5e-6, 4e-6, 9e-6, differ=False),  # slower than torch_loop
        _row(2048, "shrink", 1.25e-6, 2e-6, 10e-6, 10e-6),          # fraction 0.8, static / tuned 1.6
        _row(8192, "shrink", 2e-6, 3e-6, 10e-6, 10e-6),             # fraction 0.5, static / tuned 1.5
        _row(2048, "expand", 2e-6, 2e-6, 10e-6, 10e-6),             # fraction 0.5, static / tuned 1
    ]
    targets = kb.summarize(rows, bandwidth)
    assert [t.op for t in targets] == ["shrink"] * 4 + ["expand"] * 4
    fraction, small, speedup, slower = targets[:4]
    assert fraction.value == pytest.approx(0.65) and fraction.status == "PASS"
    assert small.value == pytest.approx(3.75) and small.status == "PASS"
    assert speedup.value == pytest.approx(1.6) and speedup.status == "PASS" and "(3 cases)" in speedup.what
    assert slower.value == 1 and slower.status == "MISS" and slower.detail == "h4096 u16 n4 t32 decode x1.12"
    fraction, small, speedup, slower = targets[4:]
    assert fraction.value == pytest.approx(0.5) and fraction.status == "MISS"  # expand's goal is 0.75
    assert small.value is None and small.status == "n/a"  # no expand case of <= 32 tokens
    assert speedup.value == pytest.approx(1.0) and speedup.status == "MISS"
    assert slower.value == 0 and slower.status == "PASS"


def test_pair_speedups_sum_both_ops_of_cases_where_either_config_differs():
    rows = [
        _row(8, "shrink", 2e-6, 8e-6, 1, 1), _row(8, "expand", 4e-6, 3e-6, 1, 1),         # (8 + 3) / (2 + 4)
        _row(32, "shrink", 3e-6, 3e-6, 1, 1, differ=False), _row(32, "expand", 2e-6, 4e-6, 1, 1),  # 7 / 5
        _row(128, "shrink", 1e-6, 1e-6, 1, 1, differ=False), _row(128, "expand", 1e-6, 2e-6, 1, 1, differ=False),
        _row(512, "shrink", 1e-6, 9e-6, 1, 1),                                              # no expand: no pair
    ]
    assert kb.pair_speedups(rows) == pytest.approx([11 / 6, 7 / 5])
    assert kb.format_pairs(kb.pair_speedups(rows)).endswith("(2 cases): 1.62")
    assert kb.format_pairs([]).endswith("(0 cases): -")


def test_report_lines_and_json(tmp_path):
    rows = [_row(8, op, 2e-6, 3e-6, 4e-6, 5e-6) for op in kb.OPS]
    targets = kb.summarize(rows, 1e9)
    line = kb.format_row(rows[0], 1e9)
    assert line.startswith("h4096 u16 n4 t8 decode") and "2.0" in line and "0.50" in line
    assert all(kb.format_target(t).split()[0] in ("PASS", "MISS", "n/a") for t in targets)
    path = tmp_path / "bench.json"
    write_json(path, kb.payload({"device": "cpu", "command": "x"}, rows, targets, 1e9))
    payload = json.loads(path.read_text())
    assert payload["complete"] and payload["device"] == "cpu" and len(payload["rows"]) == 2
    assert payload["rows"][0]["us"]["atmm_tuned"] == pytest.approx(2.0)
    assert payload["rows"][0]["fraction"]["atmm_tuned"] == pytest.approx(0.5)
    assert len(payload["summary"]) == 4 * len(kb.OPS)
    assert payload["pair_static_over_tuned"] == {"median": pytest.approx(1.5), "cases": 1}  # (3 + 3) / (2 + 2)


def test_quick_and_explicit_flags():
    args = kb.parse_args(["--quick", "--tokens", "1", "32"])
    assert args.tokens == [1, 32] and args.hidden == kb.QUICK["hidden"]
    args = kb.parse_args([])
    assert args.hidden == [4096, 3584] and args.adapters == [1, 4, 16, 64] and args.ranks == ["u16", "u64", "mixed"]
    assert args.tokens == [1, 8, 32, 128, 512, 2048, 8192] and args.layouts == ["decode", "prefill"]
