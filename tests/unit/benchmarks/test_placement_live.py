"""benchmarks/placement_live.py's `--simulate`: the cluster simulator runs the live run's setting (its
trace rows, rate, caps, SLO, workers, tiers in the adapters' own bytes per rank, the CPU Llama's model)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import placement_live
from policy.simulator import cli as simulator_cli

TRACE = Path(__file__).resolve().parents[2] / "data" / "azure_conv_trace_first500.csv"


def test_the_simulator_runs_the_live_setting(tmp_path: Path) -> None:
    args = placement_live.parse_args(["--home", str(tmp_path), "--trace", str(TRACE), "--workers", "4",
                                      "--adapters", "40", "--requests", "120", "--rate-scale", "3"])
    sizes = {f"live-{i:03d}": (8, 16, 32, 64)[i % 4] * 72_000 for i in range(40)}  # 72 kB a rank
    simulator_cli.main(placement_live.simulator_argv(args, sizes, tmp_path / "simulated"))
    data = json.loads((tmp_path / "simulated.json").read_text())
    config = data["config"]
    assert (config["workers"], config["adapters"], config["max_requests"], config["rate_scale"]) == (4, 40, 120, 3.0)
    assert (config["tpot_slo_ms"], config["ttft_slo_ms"], config["max_prompt"], config["max_output"]) == (
        200.0, 500.0, 96, 8)
    assert config["load_costs"]["bytes_per_rank"] == 72_000 and config["host_copies"] == 0
    assert config["perf_model_json"]["kind"] == "cpu-tessera-demo-llama"
    assert [r["policy"] for r in data["results"]] == ["tessera", "most-idle", "least-loaded-lru"]
    assert all(r["requests"] == 120 for r in data["results"])
