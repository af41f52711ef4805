#!/bin/bash
# Stage 2 of a soft-RoCE guest (after ci/softroce/initramfs-init switched to the overlay
# of the host's root filesystem): mounts, this node's address, the rdma_rxe module (what
# a container's host does), then the phases that ci/softroce/run wrote into the shared
# output directory (9p tag "out", mounted on /run/softroce), one after the other, each
# through ci/softroce/node-entry.sh. The nodes meet between phases through files in that
# directory. Powers the VM off at the end, failures included.
#
# $OUT/env (sourced): NNODES, SUBNET, MASTER_PORT (of the first phase), PATH_PREFIX,
#   PYTHONPATH, UCXCOMM_TOKEN, UCXCOMM_UCX, ...
# $OUT/phases: NAME#SECONDS#NPROC#EXPECT_RC#PATTERN#COMMAND, one phase a line. A phase
#   passed on this node when every rank here exited EXPECT_RC and (PATTERN non-empty) its
#   log matches PATTERN (grep -E). Result: $OUT/NAME.nodeN.rc ("RC SECONDS ok|FAIL").
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# (/tmp stays the overlay's: the checkout itself may live under the host's /tmp)
mount -t tmpfs -o mode=0755 run /run
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 shm /dev/shm
node="" dir=""
read -r cmdline < /proc/cmdline
for arg in $cmdline; do
  case "$arg" in
    softroce.node=*) node="${arg#softroce.node=}" ;;
    softroce.dir=*) dir="${arg#softroce.dir=}" ;;
  esac
done
OUT=/run/softroce
mkdir -p "$OUT"
poweroff_now() {
  sync
  echo o > /proc/sysrq-trigger
  sleep 30
}
if ! mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 out "$OUT"; then
  echo "guest: cannot mount the output directory"
  poweroff_now
fi
# shellcheck disable=SC2329 # (called by the EXIT trap)
finish() {
  local rc=$?
  echo "$rc" > "$OUT/node$node.done"
  poweroff_now
}
trap finish EXIT
say() { echo "guest[$node]: $*"; }

# shellcheck source=/dev/null
source "$OUT/env"
export PATH="$PATH_PREFIX:$PATH"
hostname "node$node"
ip link set lo up
ip addr add "$SUBNET.$((node + 1))/24" dev eth0
ip link set eth0 up
# The host side of a container's setup: the module (rdma_rxe asks for crc32 by its crypto
# name, which busybox's modprobe does not resolve by itself).
modprobe crc32_generic && modprobe rdma_rxe || exit 2
ulimit -l unlimited
say "up in $(cut -d' ' -f1 /proc/uptime) s: $(ip -o -4 addr show eth0 | awk '{print $4}'), $(uname -r)"
cd "$dir" || exit 2

# wait_for FILE SECONDS: until the file exists (written by the other node or the host)
wait_for() {
  local deadline=$((SECONDS + $2))
  until [ -e "$1" ]; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.2
  done
}

i=0
status=0
while IFS='#' read -r name limit nproc expect pattern cmd; do
  [ -n "$name" ] || continue
  # meet the other nodes: every one has finished the previous phase
  for ((n = 0; n < NNODES; n++)); do
    [ "$i" = 0 ] || wait_for "$OUT/$prev.node$n.rc" $((prevlimit + 60)) || {
      say "node $n did not finish phase $prev"
      exit 1
    }
  done
  log="$OUT/$name.node$node.log"
  t0=$(date +%s.%N)
  rc=0
  read -ra argv <<< "$cmd"
  checks=devices # (the first phase has run node-entry.sh's ucxcomm info check)
  [ "$i" != 0 ] || checks=full
  NODE_RANK="$node" NPROC_PER_NODE="$nproc" NODE_TIMEOUT="$limit" NODE_CHECKS="$checks" \
    MASTER_PORT=$((MASTER_PORT + 10 * i)) \
    timeout -s KILL $((limit + 30)) bash ci/softroce/node-entry.sh -- "${argv[@]}" \
    > "$log" 2>&1 < /dev/null || rc=$?
  took=$(echo "$(date +%s.%N) $t0" | awk '{printf "%.1f", $1 - $2}')
  verdict=ok
  if [ "$rc" != "$expect" ] || { [ -n "$pattern" ] && ! grep -qE "$pattern" "$log"; }; then
    verdict=FAIL
    status=1
  fi
  echo "$rc $took $verdict" > "$OUT/$name.node$node.rc"
  say "phase $name: $verdict (exit $rc, expected $expect; $took s)"
  prev="$name" prevlimit="$limit"
  i=$((i + 1))
done < "$OUT/phases"
exit "$status"
