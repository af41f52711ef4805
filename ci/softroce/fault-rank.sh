#!/usr/bin/env bash
# A rank of a failure phase of ci/softroce/run:
#
#   fault-rank.sh VICTIM kill|cut PROGRAM [ARGS...]
#
# Every rank but VICTIM (a global RANK) just runs PROGRAM. VICTIM runs it too and, once
# its output has a line starting with READY (the program's loop is under way):
#   kill  SIGKILLs it, prints "VICTIM-KILLED RANK" and exits 0 (the others must notice);
#   cut   takes this node's link down (RXE_NETDEV, else eth0), prints "LINK-CUT RANK",
#         and exits with PROGRAM's status (it must notice the lost peers as well); the
#         link comes back up then (the rxe device with it) for what runs next.
set -uo pipefail
victim="$1" mode="$2"
shift 2
if [ "${RANK:-}" != "$victim" ]; then
  exec "$@"
fi
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
"$@" > "$log" 2>&1 &
pid=$!
tail -n +1 -f "$log" --pid "$pid" &
tailpid=$!
until grep -q '^READY' "$log"; do
  if ! kill -0 "$pid" 2> /dev/null; then
    wait "$pid"
    rc=$?
    echo "fault-rank: rank $RANK ended (status $rc) before READY"
    exit $((rc == 0 ? 1 : rc))
  fi
  sleep 0.2
done
case "$mode" in
  kill)
    kill -KILL "$pid"
    wait "$pid" 2> /dev/null
    echo "VICTIM-KILLED $RANK"
    exit 0
    ;;
  cut)
    ip link set "${RXE_NETDEV:-eth0}" down
    echo "LINK-CUT $RANK"
    wait "$pid"
    rc=$?
    ip link set "${RXE_NETDEV:-eth0}" up
    # The tail's last lines: it prints them once it sees the rank gone (it looks once a
    # second), and the phase's verdict greps this output as soon as we exit (a fixed
    # 0.5 s sleep here lost a rank's PEER-FAILURE line that came right before its exit).
    wait "$tailpid"
    exit "$rc"
    ;;
esac
echo "fault-rank: unknown mode $mode" >&2
exit 2
