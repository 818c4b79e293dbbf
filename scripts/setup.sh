#!/usr/bin/env bash
# Create .venv and install Tessera into it (idempotent: a second run changes nothing).
#   TORCH_SPEC       torch requirement installed first (default torch==2.13.0, the CPU build)
#   TORCH_INDEX_URL  optional index for torch, e.g. https://download.pytorch.org/whl/cpu
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
  "$PY" -m pip install --disable-pip-version-check ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
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
say "ready: $("$PY" -c 'import torch; print("torch", torch.__version__)'), $VENV/bin/tessera"
