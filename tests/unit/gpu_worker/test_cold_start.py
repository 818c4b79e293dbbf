"""The cold-start policy: the way that starts a cold request first among those that keep the running
requests' steps within the TPOT objective, from measured copy, step and CPU costs."""

from __future__ import annotations

import math

import pytest

from gpu_worker.builder import _cold_start_policy
from policy.cold_start import ColdOptions, ColdStart, ColdStartPolicy
from services.common.config import ConfigError, WorkerConfig

SLO_S = 0.1


def policy(step_s: float, name: str = "auto") -> ColdStartPolicy:
    chosen = ColdStartPolicy(name, SLO_S)
    chosen.observe_step(step_s)
    return chosen


@pytest.mark.parametrize("copy_left_s, cpu_extra_s, others, expected", [
    (0.004, None, True, ColdStart.PIPELINED),   # the copy ends before the step does: nothing is late
    (0.004, 0.001, True, ColdStart.PIPELINED),  # ...nor faster on the CPU
    (0.5, None, True, ColdStart.WAIT),           # a step 0.5 s late breaks the running requests' TPOT
    (0.5, None, False, ColdStart.PIPELINED),     # alone, it only starts sooner than after the copy
    (math.inf, None, False, ColdStart.PIPELINED),  # no copy rate measured yet: alone, still no slower
    (math.inf, None, True, ColdStart.WAIT),      # beside others: no estimate to stake their steps on
    (0.5, 0.03, True, ColdStart.CPU),            # the CPU path makes the step 30 ms late, the copy 490 ms
    (None, 0.03, True, ColdStart.CPU),           # no GPU room: CPU assistance, or an unbounded wait
    (None, 0.5, True, ColdStart.WAIT),           # ...unless it breaks the others' TPOT
    (None, 0.5, False, ColdStart.CPU),           # ...which alone it cannot
    (None, None, True, ColdStart.WAIT),          # no GPU room, no CPU LoRA worker
])
def test_auto_takes_the_first_start_that_keeps_others_within_their_tpot(copy_left_s, cpu_extra_s, others, expected):
    assert policy(step_s=0.01).choose(ColdOptions(copy_left_s, cpu_extra_s, others)) is expected


@pytest.mark.parametrize("name, copy_left_s, cpu_extra_s, expected", [
    ("pipelined", 5.0, 0.001, ColdStart.PIPELINED),
    ("pipelined", None, 0.001, ColdStart.WAIT),  # no GPU placement to pipeline
    ("cpu", 0.0001, 5.0, ColdStart.CPU),
    ("cpu", 0.0001, None, ColdStart.WAIT),      # no CPU LoRA worker ready
    ("wait", 0.0001, 0.0001, ColdStart.WAIT),
])
def test_a_single_way_policy_takes_its_way_whenever_it_can(name, copy_left_s, cpu_extra_s, expected):
    assert policy(0.01, name).choose(ColdOptions(copy_left_s, cpu_extra_s, others=True)) is expected


def test_the_step_time_is_a_running_estimate():
    chosen = policy(step_s=0.01)
    for _ in range(100):
        chosen.observe_step(0.05)
    assert chosen.step_s == pytest.approx(0.05, rel=1e-3)
    # A copy with 60 ms left ends before a 50 ms step is much later than it: 10 ms late, within the TPOT.
    assert chosen.choose(ColdOptions(0.06, None, others=True)) is ColdStart.PIPELINED
    assert chosen.choose(ColdOptions(0.2, None, others=True)) is ColdStart.WAIT  # 150 ms late: 200 > 100 ms


@pytest.mark.parametrize("field, value, message", [
    ("cold_start_policy", "fastest", "expected one of auto, pipelined, cpu, wait"),
    ("default_tpot_slo_ms", 0.0, "must be positive"),
])
def test_a_bad_cold_start_setting_is_refused(field, value, message):
    with pytest.raises(ConfigError, match=message):
        _cold_start_policy(WorkerConfig(**{field: value}))


def test_the_tightest_objective_of_the_running_requests_bounds_the_stall():
    chosen = policy(step_s=0.01)  # the policy's own default: 100 ms
    copy = 0.05  # a step 40 ms late: 50 ms in all
    assert chosen.choose(ColdOptions(copy, None, others=True)) is ColdStart.PIPELINED
    assert chosen.choose(ColdOptions(copy, None, others=True, tpot_slo_s=0.03)) is ColdStart.WAIT
    assert chosen.choose(ColdOptions(copy, None, others=True, tpot_slo_s=0.06)) is ColdStart.PIPELINED
