#!/usr/bin/env bash
# A 3-host cluster on one machine: network namespaces ucxc<tag>h0..h2, each with one
# veth into a bridge that lives in a namespace of its own (nothing is created in, or
# addressed from, the caller's namespace). One rank per host, started torchrun-style
# (RANK, WORLD_SIZE, MASTER_ADDR=host 0), UCX over TCP (UCX_TLS=tcp,self: shared memory
# would cross namespaces on one machine).
#   1. p2p, collectives and one-sided windows across the hosts (tests/spmd/cluster_prog.py work)
#   2. an Allreduce/ring loop; host 2's link is cut at the bridge mid-job: every rank must
#      raise PeerFailure within UCXCOMM_LIVENESS_S (+ margin) and exit non-zero, naming
#      host 2 or a rank that had already failed on host 2 and left.
# Everything is torn down on exit, failures included. Needs root and iproute2 (without
# them it says so and exits 0, like tests/test_netns.py). Run by .ci/run.
# Uses the python on PATH when it already imports this checkout's ucxcomm, else ci/env.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ "$(id -u)" != 0 ] || ! command -v ip > /dev/null || ! ip netns list > /dev/null 2>&1; then
  echo "cluster-netns: skipped (needs root and ip netns)"
  exit 0
fi
# (asked from / so that the checkout in the working directory does not answer for python)
if [ "$(cd / && python -c 'import os, ucxcomm; print(os.path.dirname(os.path.dirname(ucxcomm.__file__)))' \
      2> /dev/null || true)" != "$ROOT" ]; then
  source "$ROOT/ci/env.sh"
fi

N=3
TAG="$(printf '%04x' $$)"
BR="ucxc${TAG}br"
HOSTS=()
for i in $(seq 0 $((N - 1))); do HOSTS+=("ucxc${TAG}h$i"); done
SUBNET=10.211.77
PORT=29600
LIVENESS=3          # UCXCOMM_LIVENESS_S for the ranks: a cut host is declared dead after ~3 s
PHASE_S=90          # bound on each phase
TOKEN="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"  # (the job's store secret)
OUT="$(mktemp -d)"
PIDS=()

cleanup() {
  local rc=$?
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2> /dev/null || true; done
  wait 2> /dev/null || true
  for ns in "${HOSTS[@]}" "$BR"; do ip netns del "$ns" 2> /dev/null || true; done
  rm -rf "$OUT"
  exit "$rc"
}
trap cleanup EXIT INT TERM

fail() { echo "cluster-netns: FAILED: $*" >&2; for f in "$OUT"/*.log; do echo "--- $f"; tail -40 "$f"; done >&2; exit 1; }

ip netns add "$BR"
ip -n "$BR" link add br0 type bridge
ip -n "$BR" link set br0 up
for i in $(seq 0 $((N - 1))); do
  h="${HOSTS[$i]}"
  ip netns add "$h"
  ip -n "$h" link set lo up
  ip -n "$BR" link add "vb$i" type veth peer name eth0 netns "$h"
  ip -n "$BR" link set "vb$i" master br0 up
  ip -n "$h" addr add "$SUBNET.$((i + 1))/24" dev eth0
  ip -n "$h" link set eth0 up
done

# start_job MODE: one rank per host, in the background; their logs in $OUT/MODE.RANK.log
start_job() {
  PIDS=()
  for i in $(seq 0 $((N - 1))); do
    ip netns exec "${HOSTS[$i]}" env RANK="$i" LOCAL_RANK=0 WORLD_SIZE="$N" LOCAL_WORLD_SIZE=1 \
      MASTER_ADDR="$SUBNET.1" MASTER_PORT="$PORT" UCX_TLS=tcp,self UCXCOMM_TRANSPORT=auto \
      UCXCOMM_LIVENESS_S="$LIVENESS" UCXCOMM_TOKEN="$TOKEN" PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 \
      timeout -s KILL "$PHASE_S" python tests/spmd/cluster_prog.py "$1" \
      > "$OUT/$1.$i.log" 2>&1 < /dev/null &
    PIDS+=("$!")
  done
}

# 1. everything works across the hosts
t0=$SECONDS
start_job work
for i in $(seq 0 $((N - 1))); do
  wait "${PIDS[$i]}" || fail "work: rank $i exited $?"
  grep -q "CLUSTER-OK $i lanes" "$OUT/work.$i.log" || fail "work: rank $i did not finish"
done
echo "cluster-netns: p2p, collectives and RMA over TCP across $N hosts: ok ($((SECONDS - t0)) s)"
grep -h "CLUSTER-OK" "$OUT"/work.*.log

# 2. cut host 2's link mid-job
PORT=$((PORT + 10))
start_job cut
deadline=$((SECONDS + 60))
until [ "$(cat "$OUT"/cut.*.log 2> /dev/null | grep -c '^READY ')" = "$N" ]; do
  [ $SECONDS -lt $deadline ] || fail "cut: the ranks did not get under way"
  for pid in "${PIDS[@]}"; do kill -0 "$pid" 2> /dev/null || fail "cut: a rank ended early"; done
  sleep 0.2  # (polling the ranks' output files for READY)
done
cut_at=$(date +%s.%N)
ip -n "$BR" link set vb2 down
for i in $(seq 0 $((N - 1))); do
  rc=0
  wait "${PIDS[$i]}" || rc=$?
  took=$(echo "$(date +%s.%N) - $cut_at" | bc)
  [ "$rc" = 3 ] || fail "cut: rank $i exited $rc (expected 3: PeerFailure; 137: killed by the $PHASE_S s bound)"
  grep -q "^PEER-FAILURE $i peer" "$OUT/cut.$i.log" || fail "cut: rank $i raised no PeerFailure"
  if [ "$i" != 2 ]; then
    # Blamed: host 2, or a rank that itself left because of host 2 (a point-to-point wait
    # depends on its sender only: rank 1 receiving from rank 0 fails when rank 0 aborts).
    blamed="$(sed -n "s/^PEER-FAILURE $i peer \([0-9]*\) .*/\1/p" "$OUT/cut.$i.log")"
    if [ "$blamed" != 2 ]; then
      { [ -n "$blamed" ] && [ "$blamed" != "$i" ] \
          && grep -q "^PEER-FAILURE $blamed peer 2 " "$OUT/cut.$blamed.log"; } \
        || fail "cut: rank $i blamed peer '$blamed', neither host 2 nor a rank that failed on it"
    fi
  fi
  printf 'cluster-netns: rank %s: %s, exited %s, %.1f s after the cut\n' "$i" \
    "$(grep '^PEER-FAILURE' "$OUT/cut.$i.log")" "$rc" "$took"
done
grep -l "Traceback\|Segmentation fault\|Fatal Python error" "$OUT"/cut.*.log && fail "cut: tracebacks"
echo "cluster-netns: link cut: every rank failed with PeerFailure and exited non-zero ($((SECONDS - t0)) s in all)"
