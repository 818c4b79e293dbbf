"""kernels on a CPU-only install, which has no triton: only kernels/triton/ (and the offline tuner)
import it, so every other module imports, and the ops run their torch references."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

WITHOUT_TRITON = """
import pkgutil, sys
sys.modules["triton"] = None  # `import triton` raises ImportError, as where it is not installed
import torch
import kernels
names = [m.name for m in pkgutil.iter_modules(kernels.__path__) if m.name not in ("triton", "tuner")]
for name in names:
    __import__(f"kernels.{name}")
out = kernels.linear(torch.ones(2, 4), torch.ones(3, 4))
assert out.tolist() == [[4.0] * 3] * 2, out
print(" ".join(sorted(names)))
"""


def test_every_module_outside_kernels_triton_imports_without_triton():
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert {"attention", "batch", "fused", "lora_stack", "merge", "reference", "tiling"} <= set(result.stdout.split())
