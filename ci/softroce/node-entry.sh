#!/usr/bin/env bash
# One soft-RoCE node: make sure it has an rxe device over its network interface, check
# that verbs and a verbs-capable UCX see it, then start this node's ranks torchrun-style
# (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: ucxcomm's bootstrap reads
# them). Shared by the Docker kit (docker/compose.yaml) and the VM harness, so that the
# VMs test what the containers run.
#
#   node-entry.sh [--check] [--] PROGRAM [ARGS...]
#
#   --check   stop after the checks (no PROGRAM needed)
#
# Environment (defaults in brackets):
#   NODE_RANK [0], NNODES [1], NPROC_PER_NODE [1]   placement of this node's ranks
#   MASTER_ADDR [127.0.0.1], MASTER_PORT [29500]    node 0's address; ucxcomm's store
#                                                   listens on MASTER_PORT + 1 there
#   RXE_NETDEV [the interface of the default route, else eth0]
#   RXE_NAME [rxe0]          the rxe device to create over RXE_NETDEV when absent
#   NODE_TIMEOUT [0: none]   seconds the ranks may run before they are killed
#   NODE_CHECKS [full]       "devices": skip the `ucxcomm info` check (a node that has
#                            already passed it, e.g. between the VM harness's phases)
#   UCXCOMM_TRANSPORT [rdma], UCXCOMM_DEVICES [RXE_NAME:1], UCXCOMM_UCX [auto]
#
# Needs: iproute2's `rdma`, ibverbs-utils' `ibv_devices`, rdma-core's libibverbs1 and
# ibverbs-providers, ucxcomm installed with the rdma extra; the kernel module rdma_rxe
# (a container cannot load it: `modprobe rdma_rxe` on the host) and CAP_NET_ADMIN to
# create the device. Exit status: the first failing rank's, 2 for a failed check.
set -euo pipefail

check_only=0
if [ "${1:-}" = "--check" ]; then
  check_only=1
  shift
fi
if [ "${1:-}" = "--" ]; then
  shift
fi
if [ "$check_only" = 0 ] && [ $# -eq 0 ]; then
  echo "usage: $0 [--check] [--] PROGRAM [ARGS...]" >&2
  exit 2
fi

node_rank="${NODE_RANK:-0}"
nnodes="${NNODES:-1}"
nproc="${NPROC_PER_NODE:-1}"
for v in "$node_rank" "$nnodes" "$nproc" "${NODE_TIMEOUT:-0}"; do
  case "$v" in
    '' | *[!0-9]*)
      echo "node-entry: NODE_RANK, NNODES, NPROC_PER_NODE and NODE_TIMEOUT must be" \
        "non-negative integers (got '$v')" >&2
      exit 2
      ;;
  esac
done
case "${NODE_CHECKS:-full}" in
  full | devices) ;;
  *)
    echo "node-entry: NODE_CHECKS must be full or devices (got '${NODE_CHECKS}')" >&2
    exit 2
    ;;
esac
if [ "$node_rank" -ge "$nnodes" ] || [ "$nproc" -lt 1 ]; then
  echo "node-entry: NODE_RANK=$node_rank must be below NNODES=$nnodes and" \
    "NPROC_PER_NODE=$nproc at least 1" >&2
  exit 2
fi

say() { echo "node-entry[$node_rank]: $*"; }
fail() {
  echo "node-entry[$node_rank]: $*" >&2
  exit 2
}

# ---------------------------------------------------------------- the rxe device
netdev="${RXE_NETDEV:-}"
if [ -z "$netdev" ]; then
  netdev="$(ip -o route show default 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}')"
  netdev="${netdev:-eth0}"
fi
rxe="${RXE_NAME:-rxe0}"
ip link show "$netdev" >/dev/null 2>&1 || fail "no network interface $netdev (set RXE_NETDEV)"

if [ ! -d "/sys/class/infiniband/$rxe" ]; then
  if [ ! -d /sys/module/rdma_rxe ] && command -v modprobe >/dev/null; then
    modprobe rdma_rxe 2>/dev/null || true # works in a VM; a container needs the host to
  fi
  [ -d /sys/module/rdma_rxe ] ||
    fail "the kernel module rdma_rxe is not loaded: run 'modprobe rdma_rxe' on the host"
  say "creating $rxe over $netdev"
  rdma link add "$rxe" type rxe netdev "$netdev" ||
    fail "'rdma link add $rxe type rxe netdev $netdev' failed (needs CAP_NET_ADMIN)"
fi
state_file="/sys/class/infiniband/$rxe/ports/1/state"
deadline=$((SECONDS + 10))
until grep -q ACTIVE "$state_file" 2>/dev/null; do
  [ "$SECONDS" -lt "$deadline" ] ||
    fail "$rxe port 1 is not ACTIVE after 10 s: $(cat "$state_file" 2>/dev/null || echo absent)"
  sleep 0.2
done
say "$(rdma link show "$rxe/1")"
# Its verbs character device: a VM's devtmpfs makes it; a container, whose /dev was
# filled when it started, gets it here (needs CAP_MKNOD and a device cgroup rule for
# major 231, as docker/compose.yaml gives).
for d in /sys/class/infiniband_verbs/uverbs*; do
  [ -e "$d/ibdev" ] && [ "$(cat "$d/ibdev")" = "$rxe" ] || continue
  node="/dev/infiniband/$(basename "$d")"
  if [ ! -e "$node" ]; then
    mkdir -p /dev/infiniband
    IFS=: read -r major minor <"$d/dev"
    mknod "$node" c "$major" "$minor" || fail "cannot create $node (needs CAP_MKNOD)"
    say "created $node"
  fi
done

# ---------------------------------------------------------------- checks
ibv_devices | grep -qw "$rxe" || fail "ibv_devices does not list $rxe (is ibverbs-providers installed?)"
say "ibv_devices lists $rxe"

export UCXCOMM_TRANSPORT="${UCXCOMM_TRANSPORT:-rdma}"
export UCXCOMM_DEVICES="${UCXCOMM_DEVICES:-$rxe:1}"
export UCXCOMM_UCX="${UCXCOMM_UCX:-auto}"
if [ "${NODE_CHECKS:-full}" = full ]; then
  info="$(ucxcomm info --json)" || fail "ucxcomm info failed (see above)"
  # ucx_resources is the chosen UCX's `ucx_info -d`; the lanes are those of an endpoint to
  # this node itself.
  printf '%s\n' "$info" | RXE="$rxe" python3 -c '
import json, os, sys
r = json.load(sys.stdin)
rxe = os.environ["RXE"] + ":1"
print("node-entry: UCX %s from %s (%s): %s" % (r["ucx_version"], r["ucx_source"], r["libucp"],
                                               r["ucx_source_why"]))
print("node-entry: verbs %s, rdmacm %s, rdma %s, libibverbs %s" % (
    r["verbs"], r["rdmacm"], r["rdma"], r["libibverbs"]))
verbs = [x for x in r["ucx_resources"] if x.split(" ")[0].endswith("/" + rxe)]
print("node-entry: ucx_info -d on %s: %s" % (rxe, ", ".join(verbs) or "nothing"))
bad = [k for k in ("verbs", "rdma") if not r[k]]
if bad or not any(x.startswith("rc_verbs/") for x in verbs):
    sys.exit("node-entry: no RDMA over %s: %s" % (rxe, "; ".join(
        str(r.get(k + "_why", k)) for k in bad) or "UCX lists no rc_verbs on it"))
' || exit 2
else
  say "ucxcomm info check skipped (NODE_CHECKS=devices)"
fi

if [ "$check_only" = 1 ]; then
  say "checks passed"
  exit 0
fi

# ---------------------------------------------------------------- the ranks
export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}" MASTER_PORT="${MASTER_PORT:-29500}"
export WORLD_SIZE=$((nnodes * nproc)) LOCAL_WORLD_SIZE="$nproc"
limit=()
if [ "${NODE_TIMEOUT:-0}" -gt 0 ]; then
  limit=(timeout --kill-after=5 "$NODE_TIMEOUT")
fi
if [ "$nproc" = 1 ]; then
  export RANK="$node_rank" LOCAL_RANK=0
  say "rank $RANK of $WORLD_SIZE: $*"
  exec "${limit[@]}" "$@"
fi
pids=()
stop() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
}
trap stop TERM INT
for ((i = 0; i < nproc; i++)); do
  RANK=$((node_rank * nproc + i)) LOCAL_RANK="$i" "${limit[@]}" "$@" &
  pids+=("$!")
  say "rank $((node_rank * nproc + i)) of $WORLD_SIZE: pid $!"
done
status=0
for pid in "${pids[@]}"; do
  rc=0
  wait "$pid" || rc=$?
  if [ "$rc" != 0 ] && [ "$status" = 0 ]; then
    status="$rc"
    stop # one rank failed: the others would wait for it until their deadlines
  fi
done
exit "$status"
