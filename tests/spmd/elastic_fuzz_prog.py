"""One schedule of the elastic fault fuzzer (tools/elastic_fuzz.py; tests/test_elastic.py).

Every rank of ``ucxcomm run --elastic -n N`` runs the same mixed workload, round by
round: a point-to-point ring (small and 1 MiB), ``Allreduce`` (8 B, compiled, and 1 MiB),
``Bcast`` from a rotating root, an object ``allgather``, and a window ``Put`` + ``Fence``.
``ELASTIC_FUZZ`` holds the schedule (JSON): the victims, and for each the round and the
step of the round before which it kills itself (SIGKILL), or, with action ``cut`` (in a
network-namespace cluster, ``tools/elastic_fuzz.py --netns``), takes its own host's link
down at the bridge (the command in ``ELASTIC_FUZZ_CUT``) and, with a heal time, brings
it back that many seconds later. Every result is checked against what the current
members must produce (a wrong byte fails the schedule). When a step raises
``PeerFailure`` or ``Revoked``, the survivor revokes, agrees, shrinks, and goes on with
the remaining rounds on the shrunk communicator. Each survivor prints ``FUZZ-OK rank R
rounds K size S recoveries C members [...]`` (world ranks) at the end; a rank that can
no longer agree (cut off: it lost the store, or its side of a partition was fenced)
prints ``FUZZ-OUT rank R: <why>`` and exits 3 after finalizing (bounded: else
``FUZZ-FINALIZE-HUNG``). Every wait is bounded (a hang fails).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import numpy as np

import ucxcomm
from ucxcomm import IN_PLACE, PeerFailure, Revoked

STEPS = ("ring", "ring_big", "allreduce", "allreduce_big", "bcast", "allgather", "window")
BIG = 1 << 17  # float64: 1 MiB


async def _round(comm, ids: list[int], win, k: int, step_hook) -> None:
    """One round of every step on ``comm`` (``ids``: its members' world ranks, in rank
    order), each result checked."""
    p, r = comm.size, comm.rank
    me = ids[r]
    right, left = (r + 1) % p, (r - 1) % p
    for step in STEPS:
        step_hook(k, step)
        if step == "ring":
            got = np.empty(4)
            await comm.Sendrecv(np.full(4, me * 1000.0 + k), right, got, source=left)
            assert (got == ids[left] * 1000.0 + k).all(), (step, got)
        elif step == "ring_big":
            got = np.empty(BIG)
            await comm.Sendrecv(np.full(BIG, me + k / 8), right, got, source=left)
            assert (got == ids[left] + k / 8).all(), (step, got[:2])
        elif step == "allreduce":
            x = np.full(1, float(me + k))
            await comm.Allreduce(IN_PLACE, x)
            assert x[0] == sum(ids) + p * k, (step, x)
        elif step == "allreduce_big":
            x = np.full(BIG, float(me))
            await comm.Allreduce(IN_PLACE, x)
            assert (x == sum(ids)).all(), (step, x[:2])
        elif step == "bcast":
            root = k % p
            x = np.full(1000, float(ids[root] * 7 + k)) if r == root else np.empty(1000)
            await comm.Bcast(x, root=root)
            assert (x == ids[root] * 7 + k).all(), (step, x[:2])
        elif step == "allgather":
            assert await comm.allgather((me, k)) == [(i, k) for i in ids], step
        elif step == "window":
            win.memory[:] = 0
            await win.Fence()
            await win.Put(np.full(8, me + k, np.uint8), right, 8 * r % 64)
            await win.Fence()
            mine = win.memory.view(np.uint8)
            at = 8 * left % 64
            assert (mine[at:at + 8] == (ids[left] + k) % 256).all(), (step, mine[at:at + 8])


async def main() -> None:
    schedule = json.loads(os.environ["ELASTIC_FUZZ"])
    rounds, deadline = schedule["rounds"], schedule["deadline"]
    comm = await ucxcomm.init()
    me = comm.rank
    kills = {int(v): tuple(a) for v, a in schedule["victims"].items()}

    def hook(k, step):
        if me not in kills or kills[me][:2] != (k, step):
            return  # (kills.pop below: once, though a round may run again)
        what = kills.pop(me)
        action = what[2] if len(what) > 2 else "kill"
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        link = json.loads(os.environ["ELASTIC_FUZZ_CUT"])
        subprocess.run(link["down"], check=True, timeout=30)
        print(f"FUZZ-CUT rank {me} round {k} step {step}", flush=True)
        heal = what[3]
        if heal is not None:  # (outlives this process: it may end first)
            subprocess.Popen(["sh", "-c", 'sleep "$0"; exec "$@"', str(heal), *link["up"]],
                             start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)

    world = comm
    ids = list(range(comm.size))
    win = await ucxcomm.Win.Allocate(comm, 64)
    k = 0
    recoveries = 0
    async with asyncio.timeout(deadline):
        while k < rounds:
            try:
                await _round(comm, ids, win, k, hook)
                completed = True
            except (PeerFailure, Revoked):
                comm.revoke()
                completed = False
            try:
                ok, failed = await comm.agree(completed)
                if failed:
                    await win.Free()  # (failed communicator: local)
                    comm = await comm.shrink()
            except PeerFailure as exc:  # (cut off, or fenced)
                print(f"FUZZ-OUT rank {me}: {exc}", flush=True)
                try:
                    await asyncio.wait_for(ucxcomm.finalize(), 15)
                except TimeoutError:
                    print(f"FUZZ-FINALIZE-HUNG rank {me}", flush=True)
                sys.exit(3)
            if failed:
                ids = [w for i, w in enumerate(ids) if i not in failed]
                win = await ucxcomm.Win.Allocate(comm, 64)
                recoveries += 1
            if ok:
                k += 1
        await win.Free()
        print(f"FUZZ-OK rank {me} rounds {k} size {comm.size} recoveries {recoveries} "
              f"members {ids}", flush=True)
        if comm is not world:
            await comm.close()
        await ucxcomm.finalize()


if __name__ == "__main__":
    asyncio.run(main())
