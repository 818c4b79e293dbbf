"""Tables (markdown), JSON and plots (PNG; matplotlib is imported only when a plot is asked for)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from policy.simulator.cluster import RunResult

SweepGrid = dict[float, list[RunResult]]  # swept value -> one result per policy, in policy order


def results_table(results: Sequence[RunResult]) -> str:
    header = ("| policy | SLO attainment | TTFT ok | TPOT ok | mean TPOT ms | p99 TPOT ms | mean TTFT ms "
              "| p99 TTFT ms | GPU hit rate | of its ceiling | GPU adapter GB | evictions GPU / host | placement moves "
              "| utilisation |")
    rows = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for r in results:
        rows.append(f"| {r.policy} | **{r.slo_attainment:.2%}** | {r.ttft_attainment:.2%} | {r.tpot_attainment:.2%} "
                    f"| {r.tpot_mean_s * 1e3:.2f} | {r.tpot_p99_s * 1e3:.2f} | {r.ttft_mean_s * 1e3:.0f} "
                    f"| {r.ttft_p99_s * 1e3:.0f} | {r.hit_rate:.1%} | {r.hit_rate / r.hit_ceiling:.3f} "
                    f"(ceiling {r.hit_ceiling:.1%}) | {r.gpu_adapter_gb:.2f} | {r.gpu_evictions} / {r.host_evictions} "
                    f"| {r.placement_moves} | {r.utilisation:.0%} |")
    return "\n".join(rows)


def sweep_tables(parameter: str, grid: SweepGrid) -> str:
    policies = [r.policy for r in next(iter(grid.values()))]
    parts = []
    for title, metric, fmt in (("SLO attainment", "slo_attainment", "{:.1%}"),
                               ("GPU adapter cache hit rate", "hit_rate", "{:.1%}"),
                               ("mean worker utilisation", "utilisation", "{:.0%}")):
        rows = [f"{title}:", "", f"| {parameter} | " + " | ".join(policies) + " |",
                "|---|" + "---|" * len(policies)]
        for value, results in grid.items():
            rows.append(f"| {value:g} | " + " | ".join(fmt.format(getattr(r, metric)) for r in results) + " |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts)


def write_json(path: Path, config: dict, results: Sequence[RunResult] | SweepGrid) -> None:
    if isinstance(results, dict):
        body = {f"{value:g}": [dataclasses.asdict(r) for r in rs] for value, rs in results.items()}
    else:
        body = [dataclasses.asdict(r) for r in results]
    path.write_text(json.dumps({"config": config, "results": body}, indent=1) + "\n")


def plot_results(path: Path, results: Sequence[RunResult], title: str) -> None:
    plt = _pyplot()
    names = [r.policy for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for ax, (label, values, fmt) in zip(axes, (
            ("SLO attainment", [r.slo_attainment for r in results], "{:.1%}"),
            ("GPU adapter cache hit rate", [r.hit_rate for r in results], "{:.1%}"),
            ("p99 TPOT / ms", [r.tpot_p99_s * 1e3 for r in results], "{:.1f}"))):
        bars = ax.barh(names, values, color=["C3" if n == "tessera" else "C0" for n in names])
        ax.bar_label(bars, [fmt.format(v) for v in values], fontsize=7, padding=2)
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.invert_yaxis()
        ax.margins(x=0.2)
    for ax in axes[:2]:
        ax.set_xlim(0, 1.2)
        ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0])
    axes[0].axvline(0.99, color="k", lw=0.8, ls="--")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_sweep(path: Path, parameter: str, grid: SweepGrid, title: str) -> None:
    plt = _pyplot()
    values = list(grid)
    policies = [r.policy for r in grid[values[0]]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, (label, metric) in zip(axes, (("SLO attainment", "slo_attainment"),
                                          ("GPU adapter cache hit rate", "hit_rate"))):
        for i, policy in enumerate(policies):
            ax.plot(values, [getattr(grid[v][i], metric) for v in values], marker="o", ms=3,
                    lw=2 if policy == "tessera" else 1, label=policy)
        ax.set_xlabel(parameter, fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    axes[0].axhline(0.99, color="k", lw=0.8, ls="--")
    axes[1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'tessera[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
