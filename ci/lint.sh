#!/usr/bin/env bash
# Static checks (run by .ci/run before the tests): ruff over the code, tests, benchmarks and
# examples; mypy over the package (configuration in pyproject.toml); the C extension's
# sources compiled on their own with -Wall -Wextra -Werror; shellcheck over the shell
# scripts, hadolint over the Dockerfile, the compose file against the Compose spec's schema
# (the copy bundled in check-jsonschema) and the Kubernetes manifests against the schemas
# bundled in kubernetes-validate (all offline). Tool versions are pinned by the `lint` extra.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/ci/env.sh"
cd "$ROOT"
python -m pip install --quiet --disable-pip-version-check -e "${ROOT}[lint]"
ruff check ucxcomm tests benchmarks examples tools
mypy
UCX_INC="$(python -c 'import libucx, os; print(os.path.join(os.path.dirname(libucx.__file__), "include"))')"
for src in csrc/*.c; do
  "${CC:-cc}" -std=gnu11 -O2 -Wall -Wextra -Werror -isystem "$UCX_INC" -Icsrc -c "$src" \
    -o /dev/null
done
shellcheck ci/*.sh ci/softroce/*.sh ci/softroce/run ci/softroce/initramfs-init
hadolint docker/Dockerfile
check-jsonschema --builtin-schema vendor.compose-spec docker/compose.yaml
kubernetes-validate --strict --quiet docs/k8s/*.yaml
echo "lint: ruff, mypy, the C sources, shell scripts, Dockerfile, compose file and" \
  "Kubernetes manifests are clean"
