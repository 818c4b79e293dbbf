"""The system the integration tests share: `tessera demo-assets` then `tessera up` on loopback, through
the benchmarks' live-system launcher (benchmarks/harness/live_system.py), which the tests also take
their helpers from (RunningSystem, spawn_role, log_tail, stop_role).

Everything runs as real processes on free ports under a temporary TESSERA_HOME,
exactly as a user would start it (a worker for each demo base model: the Llama, the LLaVA and the
Qwen2-VL), so these tests exercise every role boundary, with mutual TLS
between the roles on (the default): a test that calls a worker or the registry directly dials it
as the gateway does, with the gateway's cluster certificate (`RunningSystem.internal_channel`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.harness.live_system import DEMO_MODELS, RunningSystem, run_cli, system_env, tessera_up


@pytest.fixture(scope="session")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSystem]:
    home = tmp_path_factory.mktemp("tessera-home")
    env = system_env(home, len(DEMO_MODELS), {
        "REGISTRY__HEARTBEAT_INTERVAL_MS": 300,
        "GATEWAY__METADATA_REFRESH_S": 0.5,
        "LAUNCHER__RESTART_BACKOFF_S": 0.2,
        "WORKER__CPU_LORA_SHM_DIR": home,
    })
    run_cli(["demo-assets"], env, timeout_s=600)
    with tessera_up(env, DEMO_MODELS, home / "launcher.log") as running:
        yield running
