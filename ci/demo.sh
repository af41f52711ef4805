#!/usr/bin/env bash
# The quick-start job: installs ucxcomm into .venv if needed, then runs the multi-rank demo
# (ucxcomm run -n ${NRANKS:-2} examples/hello.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/ci/env.sh"
cd "$ROOT"
exec ucxcomm run -n "${NRANKS:-2}" --timeout 300 examples/hello.py
