"""How fast this worker's steps really run against what its performance model predicts for them.

The gateway prices a worker with the model the worker was profiled under (gpu_worker/pricing.py), alone
on its device. Live, a worker can run slower: several workers sharing CPU cores, a GPU shared with other
processes, clocks throttled by heat. Each step's measured time and the model's prediction for the same
batch feed two running means; their ratio (>1: slower than the model) goes out with every state push
(WorkerState.step_time_ratio), and the gateway scales its predictions of this worker by it. Means over
wall time (each step weighs by its own duration, `memory_s` of steps carry 1 - 1/e of the weight), so
a burst of short steps counts no more than one long one.
"""

from __future__ import annotations

import math


class StepSpeed:
    def __init__(self, memory_s: float = 2.0) -> None:
        assert memory_s > 0
        self._memory_s = memory_s
        self._measured_s = 0.0   # running means of a step's measured and predicted seconds
        self._predicted_s = 0.0

    def observe(self, predicted_s: float, measured_s: float) -> None:
        """One step: the model's prediction for its batch (0: no prediction) and its measured time."""
        if predicted_s <= 0 or measured_s <= 0:
            return
        weight = 1.0 - math.exp(-measured_s / self._memory_s)
        if not self._predicted_s:
            weight = 1.0
        self._measured_s += weight * (measured_s - self._measured_s)
        self._predicted_s += weight * (predicted_s - self._predicted_s)

    @property
    def ratio(self) -> float:
        """Measured ÷ predicted over the recent steps; 0 before any step was measured."""
        return self._measured_s / self._predicted_s if self._predicted_s else 0.0
