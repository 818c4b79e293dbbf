#!/usr/bin/env bash
# Set up, build and register the demo model and adapters, then run every role (`tessera up`).
# Arguments go to both tessera commands: e.g. `bash scripts/run.sh --config my.yaml`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
.venv/bin/tessera demo-assets "$@"
exec .venv/bin/tessera up "$@"
