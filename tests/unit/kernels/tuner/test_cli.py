"""`python -m kernels.tuner` without a GPU: the progress line and the --dry-run command line."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import tiling
from kernels.tiling import Bucket, ShrinkConfig
from kernels.tuner.__main__ import Progress, main
from kernels.tuner.candidates import tile_shapes

REPO = Path(__file__).resolve().parents[4]


def test_progress_shows_count_elapsed_eta_and_the_current_bucket():
    now = [100.0]
    stream = io.StringIO()
    progress = Progress(10, stream, clock=lambda: now[0])
    progress.show(0, "shrink|k1")
    now[0] += 50.0
    progress.show(5, "expand|k2")
    progress.note("skipped X")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[0/10] 0:00:00 elapsed, ETA ?  shrink|k1"
    assert lines[1] == "[5/10] 0:00:50 elapsed, ETA 0:00:50  expand|k2"
    assert lines[2] == "skipped X"


def test_dry_run_lists_buckets_and_candidate_counts(capsys, tmp_path):
    assert main(["--model", "llama-7b", "qwen2-7b", "--dry-run", "--ops", "shrink", "--ranks", "16",
                 "--tokens", "1", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 8 * 3 + 1  # 8 projections x (1,1), (8,1), (8,8); then the totals
    bucket = Bucket("shrink", 4096, (4096,), 16, 1, 1)  # o first
    stage1 = {tiling.heuristic_config(bucket), *tile_shapes(bucket)}
    assert lines[0].startswith(f"{bucket.key}  stage1 {len(stage1)}  stage2 <=")
    assert lines[-1].startswith("24 buckets (shrink 24, expand 0); timings: stage 1 ")
    # Sizing a continued run: buckets in the named table are left out.
    table = tmp_path / "t.json"
    tuned = {**tiling.config_dict(ShrinkConfig(16, 64, 1, 4, 3)), "us": 1.0, "heuristic_us": 2.0}
    table.write_text(json.dumps({"configs": {"shrink|k4096|n4096+4096+4096|r16|t1|g1": tuned}}))
    main(["--model", "llama-7b", "--dry-run", "--ops", "shrink", "--ranks", "16", "--tokens", "1",
          "--skip-tuned", "--table", str(table)])
    assert "n4096+4096+4096|" not in capsys.readouterr().out
    # --groups keeps the buckets of those largest-group sizes only.
    main(["--model", "llama-7b", "--dry-run", "--ops", "expand", "--ranks", "64", "--tokens", "8", "32",
          "--groups", "8", "--projections", "o"])
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines()[:-1]]
    assert keys == ["expand|k4096|n4096|r64|t8|g8", "expand|k4096|n4096|r64|t32|g8"]


def test_cli_rejects_untunable_points_and_unknown_models(capsys):
    for argv in (["--ranks", "32"], ["--tokens", "100"], ["--groups", "4"], ["--model", "no-such-model"], ["--no-merge", "--skip-tuned"]):
        with pytest.raises(SystemExit) as exc:
            main(["--model", "llama-7b", "--dry-run", *argv])
        assert exc.value.code == 2
    if not torch.cuda.is_available():
        assert main(["--model", "llama-7b", "--tokens", "1"]) == 2  # tuning needs a GPU; nothing written
    capsys.readouterr()


def test_module_entry_point_runs_the_dry_run():
    result = subprocess.run([sys.executable, "-m", "kernels.tuner", "--model", "qwen2-7b", "--dry-run",
                             "--ops", "expand", "--ranks", "64", "--tokens", "1"],
                            cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.splitlines()[-1].startswith("4 buckets (shrink 0, expand 4)")
