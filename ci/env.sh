#!/usr/bin/env bash
# Creates (once) the project's virtual environment in .venv and installs ucxcomm into it
# (editable, with the test extra): the cffi extension is compiled against the UCX headers
# of the libucx wheel during this step. Sourced by ci/test.sh and ci/demo.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
VENV="${UCXCOMM_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.ucxcomm-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ] || \
   [ "$ROOT/ucxcomm/transport/_ucp_build.py" -nt "$stamp" ] || \
   [ ! -e "$ROOT/ucxcomm/transport/_ucp.abi3.so" ]; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[test]"
  touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
