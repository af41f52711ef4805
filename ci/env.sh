#!/usr/bin/env bash
# Creates (once) the project's virtual environment in .venv and installs ucxcomm into it
# (editable, with the test and torch extras; torch pinned to 2.13.0, a local CPU build): the
# compiled extensions (Cython ucxcomm/transport/_ucp.pyx over the C in csrc/, and
# ucxcomm/comm/_fast.pyx over its declarations, and the shared-memory engine
# ucxcomm/comm/_shm.pyx; see tools/build_ucp.py) are built against
# the UCX headers of the libucx wheel during this step, our C with warnings as errors. Sourced by ci/test.sh, ci/lint.sh and ci/demo.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
VENV="${UCXCOMM_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.ucxcomm-installed"
newer=$(find "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT/tools" "$ROOT/csrc" \
        "$ROOT/ucxcomm/transport/_ucp.pyx" "$ROOT/ucxcomm/transport/_ucp.pxd" \
        "$ROOT/ucxcomm/comm/_fast.pyx" "$ROOT/ucxcomm/comm/_shm.pyx" \
        "$ROOT/ucxcomm/comm/_kernels.pxd" -newer "$stamp" \
        2>/dev/null | head -1 || true)
if [ ! -f "$stamp" ] || [ -n "$newer" ] || \
   ! compgen -G "$ROOT/ucxcomm/transport/_ucp*.so" > /dev/null || \
   ! compgen -G "$ROOT/ucxcomm/comm/_fast*.so" > /dev/null || \
   ! compgen -G "$ROOT/ucxcomm/comm/_shm*.so" > /dev/null; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  UCXCOMM_WERROR=1 "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    -e "${ROOT}[test,torch]"
  touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
