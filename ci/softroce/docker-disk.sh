#!/usr/bin/env bash
# The disk of ci/softroce/run's "containers" phase: an ext4 image of a Docker data root
# that holds IMAGE, for the VMs' dockerd (ci/softroce/docker-node.sh). The VMs have 2 GiB
# of memory and a tmpfs root; the 1.6 GB image could not be loaded there.
#
#   docker-disk.sh CACHE_DIR [IMAGE]        (IMAGE: ucxcomm:test)
#
# The image is taken from the host's engine (dockerd started when none answers, and
# stopped again), loaded into a dockerd of this script's own (its own data root, socket
# and exec root; no bridge, no iptables) with `docker save | docker load`, and that data
# root is written into CACHE_DIR/docker-ID.img by `mkfs.ext4 -d` (ID: the image's ID, 12
# hex digits). CACHE_DIR/docker.img links to it. Kept as a cache: an image already made
# for the same ID is used as it is; those of other IDs are removed. The VMs open it
# read-only, each with its own copy-on-write overlay (qemu's snapshot=on).
# Exit status: 0 with the link in place, 3 without an engine or without IMAGE in it, 1
# otherwise.
set -euo pipefail
CACHE="$1"
IMAGE="${2:-ucxcomm:test}"
say() { echo "softroce: $*"; }
fail() {
  say "FAILED: $*" >&2
  exit 1
}
mkdir -p "$CACHE"
TMP="$(mktemp -d /tmp/softroce-dockerd.XXXXXX)"
DATA="$CACHE/docker-root.tmp"
DEFAULT_PID=""
OWN_PID=""
# stop_dockerd PID: TERM, up to 30 s, then KILL
stop_dockerd() {
  kill -TERM "$1" 2> /dev/null || return 0
  for _ in $(seq 150); do kill -0 "$1" 2> /dev/null || break; sleep 0.2; done
  kill -KILL "$1" 2> /dev/null || true
  wait "$1" 2> /dev/null || true
}
# shellcheck disable=SC2329 # (called by the EXIT trap)
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  [ -z "$OWN_PID" ] || stop_dockerd "$OWN_PID"
  [ -z "$DEFAULT_PID" ] || stop_dockerd "$DEFAULT_PID"
  rm -rf "$TMP" "$DATA" "$CACHE"/docker-*.img.tmp
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' INT TERM

# wait_engine PID LOG: until `docker info` answers (DOCKER_HOST as set), 60 s at most;
# else status 1 and why in WHY
WHY=""
wait_engine() {
  local deadline=$((SECONDS + 60))
  until timeout 10 docker info > /dev/null 2>&1; do
    if ! kill -0 "$1" 2> /dev/null; then
      tail -5 "$2" >&2
      WHY="dockerd exited: $(tail -1 "$2")"
      return 1
    fi
    if [ $SECONDS -ge $deadline ]; then
      WHY="dockerd did not answer within 60 s"
      return 1
    fi
    sleep 0.3
  done
}

if ! command -v dockerd > /dev/null || ! command -v docker > /dev/null; then
  say "no Docker engine on this host (ci/docker-cluster.sh installs one)"
  exit 3
fi
t0=$SECONDS
if ! timeout 20 docker info > /dev/null 2>&1; then
  dockerd > "$TMP/default.log" 2>&1 < /dev/null &
  DEFAULT_PID=$!
  wait_engine "$DEFAULT_PID" "$TMP/default.log" || {
    say "the host's engine did not start ($WHY)"
    exit 3
  }
fi
id="$(docker image inspect -f '{{.Id}}' "$IMAGE" 2> /dev/null)" || {
  say "the host's engine has no $IMAGE (bash ci/docker-cluster.sh builds it)"
  exit 3
}
key="${id#sha256:}"
key="${key:0:12}"
DISK="$CACHE/docker-$key.img"
if [ -f "$DISK" ]; then
  ln -sfn "docker-$key.img" "$CACHE/docker.img"
  say "the containers' disk: $DISK ($IMAGE $key, cached)"
  exit 0
fi

say "making the containers' disk for $IMAGE $key (once per image)"
rm -rf "$DATA"
mkdir -p "$DATA"
echo '{}' > "$TMP/daemon.json" # (none of the host's /etc/docker/daemon.json)
dockerd --config-file "$TMP/daemon.json" --data-root "$DATA" --exec-root "$TMP/exec" \
  --pidfile "$TMP/dockerd.pid" -H "unix://$TMP/docker.sock" --storage-driver overlay2 \
  --bridge=none --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false \
  > "$TMP/own.log" 2>&1 < /dev/null &
OWN_PID=$!
DOCKER_HOST="unix://$TMP/docker.sock" wait_engine "$OWN_PID" "$TMP/own.log" || fail "$WHY"
timeout 900 docker save "$IMAGE" | DOCKER_HOST="unix://$TMP/docker.sock" timeout 900 docker load -q \
  > "$TMP/load.log" 2>&1 || {
  cat "$TMP/load.log" >&2
  fail "docker save $IMAGE | docker load"
}
got="$(DOCKER_HOST="unix://$TMP/docker.sock" docker image inspect -f '{{.Id}}' "$IMAGE")" ||
  fail "$IMAGE is not in the new data root"
[ "$got" = "$id" ] || fail "$IMAGE loaded as $got, not $id"
stop_dockerd "$OWN_PID"
OWN_PID=""
if [ -n "$DEFAULT_PID" ]; then
  stop_dockerd "$DEFAULT_PID"
  DEFAULT_PID=""
fi
# Room for the containers' writable layers and dockerd's files, and inodes for a file
# count in the tens of thousands (Python packages).
mb="$(du -sm "$DATA" | cut -f1)"
files="$(find "$DATA" -xdev | wc -l)"
size=$((mb + mb / 5 + 512))
timeout 900 mkfs.ext4 -q -F -L softroce-docker -m 0 -N $((files + files / 2 + 20000)) \
  -d "$DATA" "$DISK.tmp" "${size}M" > "$TMP/mkfs.log" 2>&1 || {
  cat "$TMP/mkfs.log" >&2
  fail "mkfs.ext4 -d $DATA"
}
mv "$DISK.tmp" "$DISK"
for old in "$CACHE"/docker-*.img; do
  [ "$old" = "$DISK" ] || rm -f "$old"
done
ln -sfn "docker-$key.img" "$CACHE/docker.img"
say "the containers' disk: $DISK (${size} MB, ${mb} MB and $files files of data root;" \
  "$((SECONDS - t0)) s)"
