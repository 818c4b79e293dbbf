"""Routing and placement on real processes, CI-sized (benchmarks/placement_live.py): `tessera up --workers 4`
of the demo Llama, 200 adapters with drifting Zipf popularity, each worker's adapter tiers a fraction of the
adapter set, arrivals from the shared conv trace. Tessera's routing with the registry's placement keeps
nearly as many requests within their SLO as most-idle and finds adapters on the chosen worker's GPU tier
far more often, on the same requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import placement_live

pytestmark = pytest.mark.integration


TRACE = Path(__file__).resolve().parents[1] / "data" / "azure_conv_trace_first500.csv"  # tests/data/README.md


def test_tessera_with_placement_keeps_the_slo_and_beats_most_idle_on_adapter_hits(tmp_path: Path) -> None:
    tessera, most_idle = placement_live.main([
        "--home", str(tmp_path / "home"), "--trace", str(TRACE), "--workers", "4", "--adapters", "200", "--requests", "120",
        "--rate-scale", "3", "--policies", "tessera,most-idle"])
    assert tessera.errors == most_idle.errors == 0
    assert tessera.planned_gpu_replicas > 0 and most_idle.planned_gpu_replicas == 0  # placement is Tessera's alone
    # SLO attainment against most-idle's on the same requests in the same run: latency is the machine's (a
    # busy 2-core CI machine made 94.2% of an absolute 95% bar). On 2 shared cores Tessera, which packs
    # requests onto the workers holding their adapters while its placement's preloads take CPU from the
    # steps, kept 87.5-100% within SLO where most-idle kept 97.5-100% (idle and beside a CPU hog,
    # 2026-11-29): the bar allows that gap, and catches a policy that stops meeting its objectives.
    assert tessera.slo_attainment >= most_idle.slo_attainment - 0.2, (tessera, most_idle)
    assert tessera.hit_rate > most_idle.hit_rate + 0.05
    assert tessera.hit_ceiling == most_idle.hit_ceiling  # the same requests
