#!/usr/bin/env bash
# The system programs the tests use beside the Python packages: PostgreSQL's server (the registry's tests
# also run against a live one, tests/postgres.py) and kubectl (renders the Kubernetes manifests,
# tests/unit/deploy/test_kubernetes.py). Installs what is missing from Debian's packages where it can
# (root, or sudo without a password); otherwise names what to install and fails.
set -euo pipefail
say() { echo "[system] $*"; }

missing=()
if ! { command -v pg_ctl && command -v initdb; } >/dev/null && ! compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null; then
  missing+=(postgresql)
fi
command -v kubectl >/dev/null || missing+=(kubernetes-client)
if [ ${#missing[@]} -eq 0 ]; then
  say "PostgreSQL server and kubectl present"
  exit 0
fi

if [ "$(id -u)" = 0 ]; then
  as_root=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  say "missing: ${missing[*]}; install them (Debian: sudo apt-get install ${missing[*]})" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  say "missing: ${missing[*]}, and no apt-get to install them with: install PostgreSQL's server and kubectl" >&2
  exit 1
fi
say "installing ${missing[*]} from Debian's packages"
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
