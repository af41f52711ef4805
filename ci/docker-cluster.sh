#!/usr/bin/env bash
# The Docker kit, built and run for real: the image ucxcomm:test from docker/Dockerfile and a
# 3-container cluster from docker/compose.yaml (profile "tcp": services rank0..rank2 on a
# user-defined bridge network, one rank per container, torchrun-style variables, UCX over
# TCP). Run by .ci/run.
#   0. the engine: Debian's docker.io (and docker-compose) installed with apt when missing;
#      dockerd started when none answers, and stopped at the end only if started here
#   1. the image: BASE python:3.11-slim-bookworm when it can be pulled, else a base made
#      from Debian packages (ci/docker-base.sh); pip in the build uses the host's pip
#      configuration (index, CA bundle, local wheels: .pip-host/ in the build context)
#   2. `docker run --rm ucxcomm:test ucxcomm info`
#   3. p2p, collectives and windows across the containers (tests/spmd/cluster_prog.py work)
#   4. the torch backend against gloo (tests/spmd/torch_prog.py ops)
#   5. a rank program of one's own, mounted from the host (UCXCOMM_PROGS, docker/README.md)
#   6. rank2's container killed mid-collective: ranks 0 and 1 raise PeerFailure within the
#      liveness bound and exit 3 (tests/spmd/cluster_prog.py cut)
#   7. rank2's container disconnected from the network mid-collective: every rank raises
#      PeerFailure within the bound and exits 3
# Containers and networks are removed on exit, failures included; the images stay (a cache:
# docker rmi ucxcomm:test ucxcomm:test-build ucxcomm-base:bookworm). Without root, or with
# no way to get an engine, it says so in one line and exits 0, unless
# UCXCOMM_DOCKER_REQUIRED=1 (.ci/run).
# UCXCOMM_DOCKER_BASE=IMAGE: build on that base instead.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

skip() {
  if [ "${UCXCOMM_DOCKER_REQUIRED:-0}" = 1 ]; then
    echo "docker-cluster: FAILED: $* (UCXCOMM_DOCKER_REQUIRED=1)" >&2
    exit 1
  fi
  echo "docker-cluster: skipped ($*)"
  exit 0
}
[ "$(id -u)" = 0 ] || skip "needs root"

IMAGE=ucxcomm:test
LOCAL_BASE=ucxcomm-base:bookworm
PY_BASE=python:3.11-slim-bookworm
N=3
PROJECT="ucxd$(printf '%04x' $$)"
NET="${PROJECT}_cluster"     # (compose: PROJECT_NETWORK)
LIVENESS=3                   # UCXCOMM_LIVENESS_S for the ranks
BOUND=$((LIVENESS + 15))     # seconds from the kill/cut to a survivor's exit, at most
PHASE_S=150                  # bound on each phase's containers
TOKEN="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
OUT="$(mktemp -d)"
DOCKERD_PID=""
COMPOSE=()
UP=0
t_start=$SECONDS

stop_dockerd() {
  [ -n "$DOCKERD_PID" ] || return 0
  kill -TERM "$DOCKERD_PID" 2> /dev/null || true
  local deadline=$((SECONDS + 30))
  while kill -0 "$DOCKERD_PID" 2> /dev/null && [ $SECONDS -lt $deadline ]; do
    sleep 0.2  # (polling dockerd's exit)
  done
  kill -KILL "$DOCKERD_PID" 2> /dev/null || true
  wait "$DOCKERD_PID" 2> /dev/null || true
  echo "docker-cluster: stopped the dockerd it started"
  DOCKERD_PID=""
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$UP" = 1 ]; then
    timeout 120 "${COMPOSE[@]}" down --remove-orphans -t 2 > /dev/null 2>&1 || true
    # (whatever compose left: containers and the network of this project)
    timeout 60 docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" \
      | xargs -r timeout 60 docker rm -f > /dev/null 2>&1 || true
    timeout 30 docker network rm "$NET" > /dev/null 2>&1 || true
  fi
  stop_dockerd
  rm -rf "$OUT"
  exit "$rc"
}
trap cleanup EXIT INT TERM

fail() {
  echo "docker-cluster: FAILED: $*" >&2
  for f in "$OUT"/*.log; do
    [ -f "$f" ] || continue
    echo "--- $(basename "$f")"
    tail -40 "$f"
  done >&2
  exit 1
}

# 0. the engine and a compose implementation
if ! command -v dockerd > /dev/null || ! command -v docker > /dev/null \
    || ! { docker compose version > /dev/null 2>&1 || command -v docker-compose > /dev/null; }; then
  command -v apt-get > /dev/null || skip "no Docker engine and no apt-get to install one"
  echo "docker-cluster: installing docker.io and docker-compose with apt"
  { DEBIAN_FRONTEND=noninteractive timeout 300 apt-get update -q \
      && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q \
        --no-install-recommends docker.io docker-compose; } > "$OUT/apt.log" 2>&1 \
    || skip "could not install docker.io/docker-compose with apt: $(tail -1 "$OUT/apt.log")"
fi
if docker compose version > /dev/null 2>&1; then
  COMPOSE=(docker compose)
else
  COMPOSE=(docker-compose)
fi
compose_version="$("${COMPOSE[@]}" version --short 2> /dev/null || true)"
if ! timeout 20 docker info > /dev/null 2>&1; then
  echo "docker-cluster: starting dockerd"
  dockerd > "$OUT/dockerd.log" 2>&1 < /dev/null &
  DOCKERD_PID=$!
  deadline=$((SECONDS + 60))
  until timeout 10 docker info > /dev/null 2>&1; do
    kill -0 "$DOCKERD_PID" 2> /dev/null || {
      DOCKERD_PID=""
      tail -5 "$OUT/dockerd.log" >&2
      skip "dockerd did not start: $(tail -1 "$OUT/dockerd.log")"
    }
    [ $SECONDS -lt $deadline ] || fail "dockerd did not answer within 60 s"
    sleep 0.3  # (polling the engine)
  done
fi
COMPOSE+=(-p "$PROJECT" -f docker/compose.yaml --profile tcp)
echo "docker-cluster: engine $(docker version -f '{{.Server.Version}}' 2> /dev/null)," \
  "storage $(docker info -f '{{.Driver}}' 2> /dev/null), ${COMPOSE[0]} $compose_version"

# 1. the image
if [ -n "${UCXCOMM_DOCKER_BASE:-}" ]; then
  base="$UCXCOMM_DOCKER_BASE"
elif docker image inspect "$PY_BASE" > /dev/null 2>&1 \
    || timeout 120 docker pull -q "$PY_BASE" > "$OUT/pull.log" 2>&1; then
  base="$PY_BASE"
else
  echo "docker-cluster: $PY_BASE cannot be pulled ($(tail -1 "$OUT/pull.log" | cut -c1-100));" \
    "a base from Debian packages instead"
  timeout 900 bash ci/docker-base.sh "$LOCAL_BASE" || fail "ci/docker-base.sh failed"
  base="$LOCAL_BASE"
fi
# The build context: the checkout's files (tracked and untracked, not ignored) and
# .pip-host/ with the host's pip configuration: its index URLs as they are, and copies of
# what it names on this host's disk (CA bundle, constraints, find-links directories).
mkdir -p "$OUT/ctx/.pip-host"
git ls-files -z -co --exclude-standard | tar -cf "$OUT/context.tar" --null -T -
python3 - "$OUT/ctx/.pip-host" << 'EOF'
import os, shutil, subprocess, sys
dest = sys.argv[1]
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                     capture_output=True, text=True).stdout
conf = {}
rank = {":env:": 3, "install": 2, "global": 1}
seen = {}
for line in out.splitlines():
    key, _, val = line.partition("=")
    section, _, name = key.rpartition(".")
    val = val.strip().strip("'\"")
    r = rank.get(section, 0)
    if name and r >= seen.get(name, 0):
        conf[name], seen[name] = val, r
lines, notes = [], []
def local(path):
    return path[len("file://"):] if path.startswith("file://") else path
for name in ("index-url", "extra-index-url", "trusted-host", "default-timeout", "timeout"):
    if name in conf:
        vals = [v for v in conf[name].split() if not v.startswith("file:")]
        notes += [f"{name} {v} (local index, not passed)" for v in conf[name].split()
                  if v.startswith("file:")]
        if vals:
            lines.append(f"{name} = {' '.join(vals)}")
if os.path.isfile(conf.get("cert", "")):
    shutil.copy(conf["cert"], os.path.join(dest, "cert.pem"))
    lines.append("cert = /src/.pip-host/cert.pem")
if os.path.isfile(conf.get("constraint", "")):
    shutil.copy(conf["constraint"], os.path.join(dest, "constraints.txt"))
    lines.append("constraint = /src/.pip-host/constraints.txt")
links = []
for i, v in enumerate(conf.get("find-links", "").split()):
    if os.path.isdir(local(v)):
        os.symlink(os.path.abspath(local(v)), os.path.join(dest, f"links{i}"))
        links.append(f"/src/.pip-host/links{i}")
    elif not os.path.exists(local(v)):
        links.append(v)
if links:
    lines.append(f"find-links = {' '.join(links)}")
with open(os.path.join(dest, "pip.conf"), "w") as f:
    f.write("[global]\n" + "".join(line + "\n" for line in lines))
print("docker-cluster: pip in the build:", "; ".join(lines + notes) or "pip's defaults")
EOF
tar -rhf "$OUT/context.tar" -C "$OUT/ctx" .pip-host
build_args=(--build-arg "BASE=$base")
docker buildx version > /dev/null 2>&1 || export DOCKER_BUILDKIT=0  # (the legacy builder)
echo "docker-cluster: building $IMAGE on $base"
t0=$SECONDS
# The build stage is tagged too (ucxcomm:test-build): its layers (the dependencies) are the
# cache of the next build; superseded layers of earlier builds are pruned.
timeout 1800 docker build "${build_args[@]}" --target build -f docker/Dockerfile \
  -t "$IMAGE-build" - < "$OUT/context.tar" > "$OUT/build.log" 2>&1 || fail "docker build failed"
timeout 1800 docker build "${build_args[@]}" -f docker/Dockerfile -t "$IMAGE" - \
  < "$OUT/context.tar" >> "$OUT/build.log" 2>&1 || fail "docker build failed"
rm -f "$OUT/context.tar"
timeout 300 docker image prune -f --filter label=org.ucxcomm.image=ucxcomm > /dev/null \
  || fail "docker image prune"
size="$(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1 / 1e9}')"
echo "docker-cluster: built $IMAGE in $((SECONDS - t0)) s ($size;" \
  "$(grep -c '^ ---> Using cache' "$OUT/build.log" || true) steps from the cache)"

# 2. what the image's UCX and ucxcomm see
timeout 120 docker run --rm "$IMAGE" ucxcomm info > "$OUT/info.log" 2>&1 \
  || fail "docker run --rm $IMAGE ucxcomm info failed"
echo "docker-cluster: docker run --rm $IMAGE ucxcomm info:"
sed 's/^/  | /' "$OUT/info.log" | head -30

# compose up PHASE CMD: one rank per container (services rank0..rank2), detached
UP=1
up() {
  RANK_CMD="$2" WORLD_SIZE="$N" UCXCOMM_TOKEN="$TOKEN" UCXCOMM_LIVENESS_S="$LIVENESS" \
    timeout 180 "${COMPOSE[@]}" up -d --no-build rank0 rank1 rank2 > "$OUT/$1.up.log" 2>&1 \
    || fail "$1: compose up failed"
  CIDS=()
  for i in $(seq 0 $((N - 1))); do
    CIDS+=("$(timeout 60 "${COMPOSE[@]}" ps -q "rank$i")")
    [ -n "${CIDS[$i]}" ] || fail "$1: no container for rank$i"
  done
}
# finish PHASE I: wait (bounded) for rank I's container; its log in $OUT/PHASE.I.log, its
# exit code in RC
finish() {
  RC="$(timeout "$PHASE_S" docker wait "${CIDS[$2]}")" || fail "$1: rank$2 still running after $PHASE_S s"
  timeout 60 docker logs "${CIDS[$2]}" > "$OUT/$1.$2.log" 2>&1 || true
}
down() { timeout 120 "${COMPOSE[@]}" down --remove-orphans -t 2 > /dev/null 2>&1 || fail "compose down"; }
# ended_at I: when rank I's container ended (seconds since the epoch)
ended_at() { date -d "$(docker inspect -f '{{.State.FinishedAt}}' "${CIDS[$1]}")" +%s.%N; }

# every_rank NAME MARKER: wait for each rank of phase NAME, which must exit 0 and print
# MARKER (with @ replaced by its rank) in its log; then tear the phase down.
every_rank() {
  local i
  for i in $(seq 0 $((N - 1))); do
    finish "$1" "$i"
    [ "$RC" = 0 ] || fail "$1: rank $i exited $RC"
    grep -q "${2//@/$i}" "$OUT/$1.$i.log" || fail "$1: rank $i did not print its result"
  done
  down
}

# 3. p2p, collectives, windows
t0=$SECONDS
up work "python tests/spmd/cluster_prog.py work"
every_rank work "CLUSTER-OK @ lanes"
echo "docker-cluster: p2p, collectives and windows over TCP across $N containers: ok ($((SECONDS - t0)) s)"
grep -h "CLUSTER-OK" "$OUT"/work.*.log

# 4. the torch backend
t0=$SECONDS
up torch "python tests/spmd/torch_prog.py ops"
every_rank torch "TORCH-OK ops rank @"
echo "docker-cluster: torch.distributed backend ucxcomm (every op against gloo) across $N containers: ok ($((SECONDS - t0)) s)"

# 5. a program of one's own: nothing but the image, the variables and a mounted directory
t0=$SECONDS
mkdir -p "$OUT/progs"
cat > "$OUT/progs/mine.py" << 'EOF'
import asyncio, socket
import ucxcomm

async def main():
    async with ucxcomm.init() as comm:
        total = await comm.allreduce(comm.rank + 1)
        names = await comm.allgather(socket.gethostname())
        print(f"MINE rank {comm.rank}/{comm.size} on {names[comm.rank]}: sum {total}, hosts {names}")

asyncio.run(main())
EOF
UCXCOMM_PROGS="$OUT/progs" up mine "python /progs/mine.py"
every_rank mine "MINE rank @/$N on rank@: sum $((N * (N + 1) / 2))"
echo "docker-cluster: a rank program of one's own (mounted at /progs): ok ($((SECONDS - t0)) s)"
grep -h "^MINE" "$OUT"/mine.*.log

# 6./7. failures mid-collective: MODE kill (docker kill) or cut (network disconnect)
failure() {
  local mode="$1" t0=$SECONDS at took i blamed
  up "$mode" "python tests/spmd/cluster_prog.py cut"
  local deadline=$((SECONDS + 90))
  until [ "$(for c in "${CIDS[@]}"; do timeout 20 docker logs "$c" 2>&1; done \
              | grep -c '^READY ')" = "$N" ]; do
    [ $SECONDS -lt $deadline ] || fail "$mode: the ranks did not get under way"
    for c in "${CIDS[@]}"; do
      [ "$(docker inspect -f '{{.State.Running}}' "$c")" = true ] || fail "$mode: a rank ended early"
    done
    sleep 0.3  # (polling the ranks' output for READY)
  done
  at=$(date +%s.%N)
  if [ "$mode" = kill ]; then
    timeout 60 docker kill "${CIDS[2]}" > /dev/null || fail "kill: docker kill"
  else
    timeout 60 docker network disconnect -f "$NET" "${CIDS[2]}" || fail "cut: network disconnect"
  fi
  # Every rank's exit and log first: a rank's blame is checked against another rank's log
  local -a RCS TOOK
  for i in $(seq 0 $((N - 1))); do
    finish "$mode" "$i"
    RCS[i]=$RC
    TOOK[i]=$(echo "$(ended_at "$i") - $at" | bc)
  done
  for i in $(seq 0 $((N - 1))); do
    RC=${RCS[$i]} took=${TOOK[$i]}
    if [ "$mode" = kill ] && [ "$i" = 2 ]; then
      [ "$RC" = 137 ] || fail "kill: rank 2's container exited $RC, not 137 (SIGKILL)"
      printf 'docker-cluster: %s: rank 2 killed (exit 137)\n' "$mode"
      continue
    fi
    [ "$RC" = 3 ] || fail "$mode: rank $i exited $RC (expected 3: PeerFailure)"
    grep -q "^PEER-FAILURE $i peer" "$OUT/$mode.$i.log" || fail "$mode: rank $i raised no PeerFailure"
    if [ "$i" != 2 ]; then
      # Blamed: rank 2, or a rank that itself left because of rank 2 (as in cluster-netns.sh)
      blamed="$(sed -n "s/^PEER-FAILURE $i peer \([0-9]*\) .*/\1/p" "$OUT/$mode.$i.log")"
      if [ "$blamed" != 2 ]; then
        { [ -n "$blamed" ] && [ "$blamed" != "$i" ] \
            && grep -q "^PEER-FAILURE $blamed peer 2 " "$OUT/$mode.$blamed.log"; } \
          || fail "$mode: rank $i blamed peer '$blamed', neither rank 2 nor a rank that failed on it"
      fi
    fi
    [ "$(echo "$took <= $BOUND" | bc)" = 1 ] || fail "$mode: rank $i exited $took s after, over $BOUND s"
    printf 'docker-cluster: %s: rank %s: %s, exited %s, %.1f s after\n' "$mode" "$i" \
      "$(grep '^PEER-FAILURE' "$OUT/$mode.$i.log")" "$RC" "$took"
  done
  ! grep -l "Traceback\|Segmentation fault\|Fatal Python error" "$OUT/$mode".*.log \
    || fail "$mode: tracebacks"
  down
  echo "docker-cluster: $mode mid-collective: the others raised PeerFailure and exited" \
    "within $BOUND s (UCXCOMM_LIVENESS_S=$LIVENESS) ($((SECONDS - t0)) s)"
}
failure kill
failure cut
UP=0
echo "docker-cluster: all phases passed ($((SECONDS - t_start)) s in all)"
