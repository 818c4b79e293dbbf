"""benchmarks/tuner_headroom.py on CPU: case parsing, and the search on a case's own batches with a
fake timer (the ATMM kernels run in Triton's interpreter, see tests/conftest.py)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
import torch

from benchmarks import kernel_bench as kb
from benchmarks import tuner_headroom as th
from kernels import tune, tuning


def test_case_specs_name_kernel_bench_cases():
    case = th.parse_case("48 mixed 4 12 prefill")
    assert case == kb.make_case(48, "mixed", 4, 12, "prefill")
    for bad in ("48 mixed 4 12", "48 mixed four 12 prefill", "48 u7 4 12 prefill", "48 mixed 4 12 sideways"):
        with pytest.raises(argparse.ArgumentTypeError, match="HIDDEN RANKS ADAPTERS TOKENS LAYOUT"):
            th.parse_case(bad)


def test_cli_rejects_a_bad_case(capsys):
    with pytest.raises(SystemExit):
        th.parse_args(["--op", "shrink", "--case", "48 mixed 4 12"])
    assert "HIDDEN RANKS ADAPTERS TOKENS LAYOUT" in capsys.readouterr().err


def _config_of(calls) -> tuning.Config:
    return calls[0].args[3 if calls[0].func is th.triton_lora.lora_shrink else 4]  # shrink (x, stack, batch, config)


@pytest.mark.parametrize("op", kb.OPS)
def test_search_on_the_case_finds_the_fastest_and_reports_the_table_against_it(op):
    case = kb.make_case(64, "u16", 3, 24, "prefill")  # in_features >= the smallest K tile the tuner tries
    timed = []

    def fake_timer(calls):
        config = _config_of(calls)
        timed.append(config)
        assert len(calls) == 2  # one call per rotating copy
        return fake_timer_value(config)

    result = th.measure_headroom(op, case, "cpu", torch.float32, copies=2, timer=fake_timer)
    table = tuning.lookup(tuning.bucket_of(op, *_stack_and_batch(case)), tuning.table_for(torch.device("cpu")))
    static = tuning.static_config(op, torch.device("cpu"))
    assert timed[0] == result.table_config == table
    assert timed[-1] == static and result.static_s == pytest.approx(fake_timer_value(static))
    assert result.best_s == pytest.approx(min(fake_timer_value(c) for c in timed))
    assert result.best_s <= min(result.table_s, result.static_s)
    assert fake_timer_value(result.best_config) == pytest.approx(result.best_s)
    assert result.bytes == kb.min_bytes(op, case)
    line = result.line(bandwidth=1e12)
    assert case.name in line and f"{result.table_s / result.best_s:.2f}x" in line
    assert f"static/best {result.static_s / result.best_s:.2f}x" in line


def test_static_expand_reads_the_static_shrinks_y(monkeypatch):
    """As kernel_bench's atmm_static: the static expand is timed on y from the static shrink, the
    others on the tuned shrink's."""
    case = kb.make_case(64, "u16", 3, 24, "prefill")
    static_shrink = tuning.static_config("shrink", torch.device("cpu"))
    ys_by_config: dict = {}
    real_shrink = th.triton_lora.lora_shrink

    def recording_shrink(x, stack, batch, config=None, *rest):
        y = real_shrink(x, stack, batch, config, *rest)
        ys_by_config.setdefault(config, []).append(y)
        return y

    monkeypatch.setattr(th.triton_lora, "lora_shrink", recording_shrink)
    timed_ys = []

    def fake_timer(calls):
        timed_ys.append([call.args[1] for call in calls])  # lora_expand(out, y, ...)
        return fake_timer_value(_config_of(calls))

    th.measure_headroom("expand", case, "cpu", torch.float32, copies=2, timer=fake_timer)
    assert all(y is want for y, want in zip(timed_ys[-1], ys_by_config[static_shrink], strict=True))
    assert all(y is want for ys in timed_ys[:-1] for y, want in zip(ys, ys_by_config[None], strict=True))


def test_summary_gives_the_medians_over_all_cases_and_where_the_configs_differ():
    case = kb.make_case(64, "u16", 3, 24, "prefill")
    static = tuning.static_config("expand", torch.device("cpu"))
    other = replace(static, block_n=2 * static.block_n)
    results = [th.Headroom(case, "expand", 1, table_config, table, table_config, best, static, static_s)
               for table_config, table, best, static_s in [(other, 2.0, 1.0, 4.0), (other, 1.0, 1.0, 1.5),
                                                          (other, 3.0, 1.0, 3.0), (static, 1.0, 1.0, 1.0)]]
    assert th.summary(results).splitlines() == [
        "4 cases: median table/best 1.50x, static/table 1.250x, static/best 2.250x (3 at least 1.3x)",
        "3 cases where the table's and the static configuration differ: median table/best 2.00x, static/table 1.500x, "
        "static/best 3.000x (3 at least 1.3x)"]


def fake_timer_value(config) -> float:
    """Wider tiles, more warps and stages are faster; nothing runs."""
    return 1e-6 * (100 - config.block_m / 8 - config.num_warps - config.num_stages)


def _stack_and_batch(case):
    stack, batches, _, _ = kb.case_inputs(case, 1, "cpu", torch.float32)
    return stack, batches[0]


def test_profile_target_runs_a_case_on_cpu(monkeypatch):
    from benchmarks import profile_lora_case
    calls = []
    real_expand = profile_lora_case.triton_lora.lora_expand
    monkeypatch.setattr(profile_lora_case.triton_lora, "lora_expand",
                        lambda *args: calls.append(args) or real_expand(*args))
    profile_lora_case.run(kb.make_case(32, "u16", 2, 6, "prefill"), repeats=2, device="cpu", dtype=torch.float32)
    assert len(calls) == 2
