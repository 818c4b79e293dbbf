"""The scheduler prices a cold request against the running requests' own TPOT objectives: CPU
assistance that would make their step later than the tightest of them is not taken."""

from __future__ import annotations

import pytest

from gpu_worker.block_manager import BlockManager
from policy.cold_start import ColdStart, ColdStartPolicy
from gpu_worker.scheduler import Scheduler, SchedulerLimits
from gpu_worker.sequence import SamplingParams, Sequence

from .adapter_fakes import Disk, manager, poll_until, ref

CPU_EXTRA_S = 0.05  # what the fake CPU LoRA workers add to a step
STEP_S = 0.01


@pytest.mark.parametrize("running_slo_s, admitted, way", [(0.03, False, None), (0.2, True, ColdStart.CPU)])
def test_cpu_assistance_is_taken_only_within_the_running_requests_tpot(running_slo_s, admitted, way):
    adapters, _ = manager(1, Disk())  # one GPU slot: the running request's adapter holds it
    policy = ColdStartPolicy("auto", tpot_slo_s=1.0)  # a loose default: the request's own objective decides
    policy.observe_step(STEP_S)
    scheduler = Scheduler(SchedulerLimits(4, max_batch_tokens=64), BlockManager(9, 4), adapters, policy,
                          cpu_extra_s=lambda tokens, packed: CPU_EXTRA_S)
    sql, chat = ref("sql", rank=2), ref("chat", rank=2)
    running = Sequence("running", [1] * 3, SamplingParams(), sql, None)
    running.tpot_slo_s = running_slo_s
    scheduler.add(running)
    poll_until(adapters, lambda: adapters.resident(sql) is not None)
    scheduler.schedule()
    cold = Sequence("cold", [1] * 3, SamplingParams(), chat, None)
    scheduler.add(cold)
    poll_until(adapters, lambda: adapters.where(chat).host is not None)  # read; no GPU room for it

    batch = scheduler.schedule()
    assert (cold in [item.seq for item in batch.items]) is admitted
    assert (cold.cpu_adapter is not None) is admitted
    assert policy.started[ColdStart.CPU] == (way is ColdStart.CPU)
