"""gpu_worker/step_speed.py: the ratio of steps' measured time to the performance model's prediction,
a running mean over wall time."""

from __future__ import annotations

import pytest

from gpu_worker.step_speed import StepSpeed


def test_the_ratio_is_measured_over_predicted_and_follows_a_slowdown_within_its_memory() -> None:
    speed = StepSpeed(memory_s=1.0)
    assert speed.ratio == 0.0  # nothing measured yet
    for _ in range(50):
        speed.observe(predicted_s=0.010, measured_s=0.010)
    assert speed.ratio == pytest.approx(1.0)
    for _ in range(300):  # 3 s of steps at twice the predicted time: three memories
        speed.observe(predicted_s=0.010, measured_s=0.020)
    assert speed.ratio == pytest.approx(2.0, rel=0.1)


def test_steps_weigh_by_their_duration_and_unpriced_steps_are_left_out() -> None:
    speed = StepSpeed(memory_s=1.0)
    speed.observe(predicted_s=0.5, measured_s=0.5)
    for _ in range(10):  # a burst of short steps, slow against the model, 10 ms in all
        speed.observe(predicted_s=0.0005, measured_s=0.001)
    assert speed.ratio == pytest.approx(1.0, abs=0.05)
    speed.observe(predicted_s=0.0, measured_s=5.0)  # no prediction (no model): no evidence
    assert speed.ratio == pytest.approx(1.0, abs=0.05)
