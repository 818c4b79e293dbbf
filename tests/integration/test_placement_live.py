"""Routing and placement on real processes, CI-sized (benchmarks/placement_live.py): `tessera up --workers 4`
of the demo Llama, 200 adapters with drifting Zipf popularity, each worker's adapter tiers a fraction of the
adapter set, arrivals from the shared conv trace. Tessera's routing with the registry's placement keeps
nearly every request within its SLO and finds adapters on the chosen worker's GPU tier far more often
than most-idle, on the same requests."""

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
    # Both keep nearly every request within SLO on this light load; 120 requests on 2 shared cores make
    # a point or two of difference noise (98.3% against 100% in one CI run), so the bar is absolute.
    assert tessera.slo_attainment >= 0.95 and most_idle.slo_attainment >= 0.95
    assert tessera.hit_rate > most_idle.hit_rate + 0.05
    assert tessera.hit_ceiling == most_idle.hit_ceiling  # the same requests
