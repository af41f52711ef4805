#!/usr/bin/env bash
# Makes a local base image equivalent to python:3.11-slim-bookworm for docker/Dockerfile
# from Debian packages, for hosts that cannot pull from an image registry:
#   debootstrap --variant=minbase bookworm + Python 3.11 (venv, headers) + rdma-core's user
#   libraries and tools, imported with `docker import`.
#
#   ci/docker-base.sh [NAME]        (default ucxcomm-base:bookworm; kept when it exists)
#   docker build --build-arg BASE=ucxcomm-base:bookworm -f docker/Dockerfile ...
#
# The Debian mirror is the host's own (the first deb URI of its apt sources), else
# debootstrap's default. Needs root, a running Docker engine and debootstrap (installed
# with apt-get when missing).
set -euo pipefail
NAME="${1:-ucxcomm-base:bookworm}"
if docker image inspect "$NAME" > /dev/null 2>&1; then
  echo "docker-base: $NAME exists (docker rmi $NAME to make it again)"
  exit 0
fi
if ! command -v debootstrap > /dev/null; then
  echo "docker-base: apt-get install debootstrap"
  DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q --no-install-recommends \
    debootstrap > /dev/null 2>&1 || {
    echo "docker-base: needs debootstrap, and apt-get could not install it" >&2
    exit 2
  }
fi
mirror=""
for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list; do
  [ -f "$f" ] || continue
  mirror="$(sed -n -e 's/^URIs:[[:space:]]*\([^[:space:]]*\/debian\)[[:space:]]*$/\1/p' \
    -e 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]*\/debian\)[[:space:]].*/\2/p' \
    "$f" | head -1)"
  [ -z "$mirror" ] || break
done
DIR="$(mktemp -d)"
trap 'rm -rf "$DIR"' EXIT
# python3-venv: ensurepip for ci/env.sh's venv; python3-dev: the headers the extension
# builds against (the python image has both); the rdma-core packages docker/Dockerfile
# installs are here already, so that its apt step is quick.
pkgs=python3,python3-venv,python3-dev,ca-certificates,libibverbs1,ibverbs-providers
pkgs+=,librdmacm1,ibverbs-utils,iproute2
t0=$SECONDS
echo "docker-base: debootstrap bookworm (${mirror:-debootstrap default mirror}) into $DIR"
# (a mirror of none: debootstrap's default; $mirror is empty or one URI)
# shellcheck disable=SC2086
debootstrap --variant=minbase --include="$pkgs" bookworm "$DIR" $mirror > "$DIR.log" 2>&1 || {
  tail -20 "$DIR.log" >&2
  rm -f "$DIR.log"
  echo "docker-base: debootstrap failed" >&2
  exit 1
}
rm -f "$DIR.log"
rm -rf "$DIR"/var/lib/apt/lists/* "$DIR"/var/cache/apt/archives/*.deb
tar -C "$DIR" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' \
  --message "ucxcomm base: Debian bookworm minbase + python3.11 + rdma-core" - "$NAME" > /dev/null
echo "docker-base: $NAME made in $((SECONDS - t0)) s ($(docker image inspect -f '{{.Size}}' "$NAME" | awk '{printf "%.0f MB", $1 / 1e6}'))"
