#!/usr/bin/env bash
# Static checks (not part of .ci/run): ruff over the code, tests and benchmarks; mypy over
# the package (configuration in pyproject.toml). Tool versions are pinned by the `lint` extra.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/ci/env.sh"
cd "$ROOT"
python -m pip install --quiet --disable-pip-version-check -e "$ROOT[lint]"
ruff check ucxcomm tests benchmarks examples
mypy
