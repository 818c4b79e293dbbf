#!/usr/bin/env bash
# Create .venv and install Tessera into it (idempotent: a second run changes nothing).
#   TORCH_SPEC       torch requirement installed first (default torch==2.13.0)
#   TORCH_INDEX_URL  optional index for torch, e.g. https://download.pytorch.org/whl/cu128; without it, a
#                    machine with no NVIDIA driver takes the CPU build from PyTorch's CPU index (if reachable)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
VENV=.venv
PY="$VENV/bin/python"
say() { echo "[setup] $*"; }

if [ ! -x "$PY" ]; then
  say "creating $VENV with $(python3 --version)"
  python3 -m venv "$VENV"
fi

# Without an NVIDIA driver, PyPI's torch (the CUDA build: gigabytes of nvidia-* wheels) is of no use: take the
# CPU build from PyTorch's CPU index, whose `+cpu` release outranks PyPI's of the same version.
CPU_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX_ARGS=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  TORCH_INDEX_ARGS=(--index-url "$TORCH_INDEX_URL")
elif [ ! -e /proc/driver/nvidia/version ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  if timeout 5 python3 -c 'import socket; socket.getaddrinfo("download.pytorch.org", 443)' 2>/dev/null; then
    TORCH_INDEX_ARGS=(--extra-index-url "$CPU_INDEX")
    say "no NVIDIA driver: torch's CPU build from $CPU_INDEX"
  else
    say "no NVIDIA driver, and $CPU_INDEX cannot be reached: torch from pip's configured indexes"
  fi
fi

# torch goes in first and alone, so the project install below cannot pick another build.
if "$PY" - "$TORCH_SPEC" <<'PY' 2>/dev/null
import importlib.metadata, sys
from pip._vendor.packaging.requirements import Requirement
import torch  # noqa: F401  (importable, not just listed)
requirement = Requirement(sys.argv[1])
sys.exit(0 if requirement.specifier.contains(importlib.metadata.version("torch"), prereleases=True) else 1)
PY
then
  say "torch already satisfies $TORCH_SPEC"
else
  say "installing $TORCH_SPEC (a large download the first time)"
  "$PY" -m pip install --disable-pip-version-check "${TORCH_INDEX_ARGS[@]}" "$TORCH_SPEC"
fi

# Pin the installed torch for every later pip run in this venv.
CONSTRAINT="$VENV/torch-constraint.txt"
"$PY" -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' > "$CONSTRAINT"

# Reinstall the project only when its dependencies changed (pyproject.toml is their one source).
STAMP="$VENV/.tessera-installed"
WANT="$(cat pyproject.toml "$CONSTRAINT" | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/tessera" ]; then
  say "tessera and its test dependencies already installed"
else
  say "installing tessera (editable) with test dependencies; torch pinned by $CONSTRAINT"
  "$PY" -m pip install --disable-pip-version-check --constraint "$CONSTRAINT" -e ".[test]"
  echo "$WANT" > "$STAMP"
fi
say "ready: $("$PY" -c 'import torch; print("torch", torch.__version__, "(CUDA " + torch.version.cuda + " build)" if torch.version.cuda else "(CPU build)")'), $VENV/bin/tessera"
