"""benchmarks/vision_bench.py --tiny end to end on CPU: a tiny LLaVA behind the real engine, both
workloads at every concurrency level, with the caches (every image a cache hit, the prompt up to the
question from the prefix cache) and without them (every image encoded, nothing reused)."""

from __future__ import annotations

import json

from benchmarks import vision_bench as vb


def test_tiny_run_reports_every_level_and_the_caches_hit_only_when_on(tmp_path):
    out = tmp_path / "vision.json"
    vb.main(["--tiny", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["versions"]["torch"]
    rows = {(r["caches"], r["workload"], r["concurrency"]): r for r in report["rows"]}
    workloads = {w.name: w for w in vb.TINY.workloads}
    assert set(rows) == {(c, w, n) for c in ("on", "off") for w in workloads for n in vb.TINY.concurrency}
    tokens_per_image = (vb.TINY.config.vision_config.image_size // vb.TINY.config.vision_config.patch_size) ** 2
    for (caches, name, concurrency), row in rows.items():
        workload = workloads[name]
        assert row["requests"] >= vb.TINY.min_requests and row["requests"] % concurrency == 0
        # "USER:", the image tokens, the question, "ASSISTANT:"
        assert row["prompt_tokens"] == 1 + workload.images * tokens_per_image + workload.words + 1
        assert row["output_tokens"] == workload.max_tokens
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p90_ms"] and 0 < row["tpot_p50_ms"] <= row["tpot_p90_ms"]
        assert 0 < row["prep_p50_ms"] and row["preemptions"] == 0
        images = row["requests"] * workload.images
        if caches == "on":
            assert (row["image_hits"], row["image_misses"]) == (images, 0)
            assert row["prefix_hit_frac"] > 0.5
        else:
            assert (row["image_hits"], row["image_misses"]) == (0, images)
            assert row["prefix_hit_frac"] == 0
