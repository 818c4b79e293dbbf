"""The worker's standard health service tells whether its CPU LoRA workers answer jobs."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health
from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from gpu_worker.lora.cpu_assist import CpuLoraStats
from gpu_worker.server import CPU_LORA_HEALTH_SERVICE, report_cpu_lora_health


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise Aborted(code)


async def _status(servicer: health.aio.HealthServicer) -> int:
    reply = await servicer.Check(HealthCheckRequest(service=CPU_LORA_HEALTH_SERVICE), Context())
    return reply.status


def test_serving_while_every_cpu_lora_worker_is_ready():
    async def main() -> list[int]:
        servicer, stop, ready = health.aio.HealthServicer(), asyncio.Event(), [2]
        stats = lambda: SimpleNamespace(cpu_lora=CpuLoraStats(workers=2, ready=ready[0]))  # noqa: E731
        task = asyncio.create_task(report_cpu_lora_health(servicer, stats, stop, interval_s=0.01))
        seen = []
        for now_ready in (2, 1, 2):  # one died; started again
            ready[0] = now_ready
            await asyncio.sleep(0.05)
            seen.append(await _status(servicer))
        stop.set()
        await task
        return seen
    assert asyncio.run(main()) == [HealthCheckResponse.SERVING, HealthCheckResponse.NOT_SERVING,
                                   HealthCheckResponse.SERVING]


def test_not_reported_without_cpu_lora_workers():
    async def main() -> None:
        servicer, stop = health.aio.HealthServicer(), asyncio.Event()
        task = asyncio.create_task(report_cpu_lora_health(
            servicer, lambda: SimpleNamespace(cpu_lora=CpuLoraStats()), stop, interval_s=0.01))
        await asyncio.sleep(0.03)
        with pytest.raises(Aborted) as aborted:
            await _status(servicer)
        assert aborted.value.args == (grpc.StatusCode.NOT_FOUND,)
        stop.set()
        await task
    asyncio.run(main())
