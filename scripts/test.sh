#!/usr/bin/env bash
# Set up (the venv, and PostgreSQL's server and kubectl where missing), check the generated gRPC stubs are
# current, then run the test suite.
# Arguments go to pytest (default: the whole suite; GPU tests are deselected by pyproject).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
bash scripts/system_packages.sh
echo "[test] checking generated stubs (python -m protos.generate --check)"
.venv/bin/python -m protos.generate --check
echo "[test] checking the layering (lint-imports, contracts in pyproject.toml)"
.venv/bin/lint-imports --no-cache
echo "[test] pytest --durations=30 $*"
exec .venv/bin/python -m pytest --durations=30 "$@"
