#!/usr/bin/env bash
# The whole test suite, from a fresh clone: makes .venv, installs ucxcomm, runs pytest.
# Extra arguments go to pytest (e.g. ci/test.sh -k p2p).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/ci/env.sh"
cd "$ROOT"
python -c "import ucxcomm.transport._ucx as u; print('ucxcomm test run on UCX', u.ucx_version(), 'from', u.libucp_path())"
exec python -m pytest "$@"
