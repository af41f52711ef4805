#!/usr/bin/env bash
# The "containers" phase of ci/softroce/run on one VM: this node's rank runs in a container
# of the image ucxcomm:test, given the VM's rxe device the way docker/README.md tells users
# to on their own hosts (host network, the verbs and rdma_cm device nodes, memlock
# unlimited). The VM plays the container host: ci/softroce/node-entry.sh has created rxe0
# on it and started this script as the node's rank (RANK, WORLD_SIZE, MASTER_ADDR, ...).
#
#   docker-node.sh PROGRAM [ARGS...]       (PROGRAM runs in the container, in /src)
#
# 1. the Docker data root: the virtio disk /dev/vda (an ext4 image ci/softroce/run made
#    from a dockerd data root holding the image; each VM writes to its own copy-on-write
#    overlay), mounted on /var/lib/softroce-docker
# 2. dockerd (the host's, seen over 9p) on it: overlay2, no bridge, no iptables (the
#    containers use the host network), cgroup v2
# 3. docker run ... --entrypoint ci/softroce/node-entry.sh IMAGE PROGRAM ARGS: the image's
#    own node-entry.sh checks the device, verbs and UCX inside the container (it finds rxe0
#    made by the host) and starts the rank
# 4. dockerd stopped, the disk unmounted. Exit status: the container's (2: a check failed
#    here, before any container ran).
# Environment: SOFTROCE_IMAGE [ucxcomm:test], SOFTROCE_DISK [/dev/vda]; into the container
# go what docker/README.md's command passes (NODE_RANK, NNODES, MASTER_ADDR, MASTER_PORT,
# UCXCOMM_TOKEN), NODE_TIMEOUT (what is left of it), CLUSTER_LANES and Python's output
# settings: not the VM's UCXCOMM_UCX, UCXCOMM_DEVICES, PYTHONPATH (the image has its own).
set -euo pipefail
[ $# -gt 0 ] || {
  echo "usage: $0 PROGRAM [ARGS...]" >&2
  exit 2
}
node="${NODE_RANK:-0}"
image="${SOFTROCE_IMAGE:-ucxcomm:test}"
disk="${SOFTROCE_DISK:-/dev/vda}"
root=/var/lib/softroce-docker
run=/run/softroce-docker
t0=$SECONDS
say() { echo "docker-node[$node]: $*"; }
fail() {
  echo "docker-node[$node]: $*" >&2
  exit 2
}

# Only in a soft-RoCE VM (the host's /dev/vda may be its own root disk)
grep -qw 'softroce\.node=[0-9]*' /proc/cmdline || fail "runs in ci/softroce/run's VMs only"

DOCKERD_PID=""
CID=""
# shellcheck disable=SC2329 # (called by the EXIT trap)
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  [ -z "$CID" ] || timeout 30 docker kill "$CID" > /dev/null 2>&1 || true
  if [ -n "$DOCKERD_PID" ]; then
    kill -TERM "$DOCKERD_PID" 2> /dev/null || true
    for _ in $(seq 100); do kill -0 "$DOCKERD_PID" 2> /dev/null || break; sleep 0.2; done
    kill -KILL "$DOCKERD_PID" 2> /dev/null || true
  fi
  umount "$root" 2> /dev/null || true
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

# ---------------------------------------------------------------- 1. the data root
[ -b "$disk" ] || modprobe virtio_blk 2> /dev/null || true
for _ in $(seq 50); do [ -b "$disk" ] && break; sleep 0.1; done
[ -b "$disk" ] || fail "no disk $disk (ci/softroce/run attaches the image's disk to the VMs)"
# (ext4's checksums ask for crc32c by its crypto name: busybox's modprobe does not resolve it)
modprobe crc32c_generic 2> /dev/null || true
modprobe ext4 2> /dev/null || true
label="$(blkid -o value -s LABEL "$disk" 2> /dev/null || true)"
[ "$label" = softroce-docker ] ||
  fail "$disk is not ci/softroce/docker-disk.sh's disk (label '$label', not softroce-docker)"
mkdir -p "$root"
mount -t ext4 -o noatime "$disk" "$root" || fail "cannot mount $disk (ext4) on $root"

# ---------------------------------------------------------------- 2. dockerd
mountpoint -q /sys/fs/cgroup || mount -t cgroup2 cgroup2 /sys/fs/cgroup ||
  fail "cannot mount cgroup2 on /sys/fs/cgroup"
# /dev/infiniband/rdma_cm comes with rdma_ucm (what the host of a container loads too)
modprobe rdma_ucm 2> /dev/null || true
command -v dockerd > /dev/null || fail "no dockerd in the VM (the host's docker.io package)"
mkdir -p "$run"
echo '{}' > "$run/daemon.json" # (none of the host's /etc/docker/daemon.json)
dockerd --config-file "$run/daemon.json" --data-root "$root" --exec-root "$run/exec" \
  --pidfile "$run/dockerd.pid" -H "unix://$run/docker.sock" --storage-driver overlay2 \
  --bridge=none --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false \
  > "$run/dockerd.log" 2>&1 < /dev/null &
DOCKERD_PID=$!
export DOCKER_HOST="unix://$run/docker.sock"
deadline=$((SECONDS + 120))
until timeout 20 docker info > /dev/null 2>&1; do
  kill -0 "$DOCKERD_PID" 2> /dev/null || {
    DOCKERD_PID=""
    tail -20 "$run/dockerd.log" >&2
    fail "dockerd exited (its log above)"
  }
  [ "$SECONDS" -lt "$deadline" ] || {
    tail -20 "$run/dockerd.log" >&2
    fail "dockerd did not answer within 120 s"
  }
  sleep 0.5
done
id="$(docker image inspect -f '{{.Id}}' "$image" 2> /dev/null)" || fail "no image $image in $disk"
say "dockerd $(docker version -f '{{.Server.Version}}') up in $((SECONDS - t0)) s" \
  "(storage $(docker info -f '{{.Driver}}'), cgroup v$(docker info -f '{{.CgroupVersion}}'));" \
  "image $image ${id#sha256:}"

# ---------------------------------------------------------------- 3. the container
# The verbs device of this node's rxe device and the RDMA CM's, as a host gives them.
rxe="${RXE_NAME:-rxe0}"
devs=()
for d in /sys/class/infiniband_verbs/uverbs*; do
  [ -e "$d/ibdev" ] && [ "$(cat "$d/ibdev")" = "$rxe" ] || continue
  devs+=(--device "/dev/infiniband/$(basename "$d")")
done
[ ${#devs[@]} -gt 0 ] || fail "no /dev/infiniband/uverbs* for $rxe"
[ ! -e /dev/infiniband/rdma_cm ] || devs+=(--device /dev/infiniband/rdma_cm)
# The variables docker/README.md's command passes, no more: node-entry.sh's defaults in
# the image do the rest (UCXCOMM_TRANSPORT=rdma, UCXCOMM_DEVICES=rxe0:1, UCXCOMM_UCX=auto),
# as on a user's host; CLUSTER_LANES for the program, Python's output settings for the log.
envs=()
for v in NODE_RANK NNODES MASTER_ADDR MASTER_PORT UCXCOMM_TOKEN CLUSTER_LANES \
  PYTHONUNBUFFERED PYTHONFAULTHANDLER; do
  [ -z "${!v+x}" ] || envs+=(-e "$v")
done
# The rank's time: what is left of this node's (NODE_TIMEOUT), less a margin for the end.
if [ "${NODE_TIMEOUT:-0}" -gt 0 ]; then
  left=$((NODE_TIMEOUT - (SECONDS - t0) - 15))
  [ "$left" -gt 30 ] || fail "only $left s left of NODE_TIMEOUT=$NODE_TIMEOUT for the rank"
  envs+=(-e "NODE_TIMEOUT=$left")
fi
args=(--network host "${devs[@]}" --ulimit memlock=-1 --shm-size 1g "${envs[@]}"
  --entrypoint ci/softroce/node-entry.sh "$image" "$@")
say "docker run ${args[*]}"
CID="$(docker create --pull never "${args[@]}")" || fail "docker create failed"
rc=0
docker start -a "$CID" || rc=$?
docker rm -f "$CID" > /dev/null 2>&1 || true
CID=""
say "container exited $rc ($((SECONDS - t0)) s in all)"
exit "$rc"
