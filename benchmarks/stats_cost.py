"""What the traffic counters (``comm.stats()``, docs/debugging.md) cost per operation:
this tree against a baseline tree without them, alternated in fresh processes.

Run: ``python benchmarks/stats_cost.py BASE_DIR [ROUNDS]``, or ``python
benchmarks/stats_cost.py --c`` for the counting alone.

``BASE_DIR`` is a checkout of the baseline (e.g. ``git archive 5de3947 | tar -x -C
BASE_DIR``) with its extensions built in place (``python setup.py build_clib build_ext
--inplace``); each side runs with its tree first on ``PYTHONPATH``. Per round and side:

* one rank sending to itself (no second process, the least noise): 8 B ``Send`` +
  ``Recv`` (both finish in their calls: one counted send, one counted receive), and
  ``Irecv`` posted, 8 B ``Send``, ``await`` (a receive that waits);
* 8 B ``Allreduce`` at 2 and at 4 ranks (``ucxcomm run``; the budget's reference:
  2 % of it).

Each figure is the best of 20 batches (rank 0's at 2 and 4 ranks). ROUNDS (default 3)
alternates the sides' order.

``--c``: what one count costs, without Python or UCX: ``csrc/stats.c`` compiled (``cc
-O2``) with a driver that counts a send and a received message per iteration for 4 peers
(routes of 3 communicators, a protocol table of 4 rows): ns per send + receive, best of
20 batches of 10**7.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _selfloop import best, self_loops  # noqa: E402  (benchmarks/ is not a package)


async def _allreduce_child() -> None:
    import numpy as np

    import ucxcomm

    comm = await ucxcomm.init()
    a, b = np.ones(1), np.empty(1)

    async def allreduce() -> None:
        await comm.Allreduce(a, b)

    await comm.barrier()
    t = await best(allreduce, 5000)
    if comm.rank == 0:
        print(f"{t:.0f}")
    await comm.close()


_DRIVER = r"""
#include <stdio.h>
#include <time.h>
#include "ucxcomm_ucp.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(void)
{
    ucxcomm_stats_t *s = ucxcomm_stats_new();
    size_t first[4] = {0, 93, 8249, 262144};
    uintptr_t eps[4];
    uint64_t stags[4];
    double best = 1e9;
    long i, n = 10000000;
    int p, cid, kind, b;
    for (p = 0; p < 4; p++) {
        int slot = ucxcomm_stats_peer(s);
        eps[p] = (uintptr_t)0x7f0000001000ull + (uintptr_t)p * 0x2c0;
        ucxcomm_stats_route_ep(s, eps[p], slot, 1);
        ucxcomm_stats_set_rows(s, slot, 1, first, 4);
        ucxcomm_stats_set_rows(s, slot, 0, first, 3);
        for (cid = 0; cid < 3; cid++) {
            for (kind = 0; kind < 3; kind++) {
                ucxcomm_stats_route_src(s, 24, ((uint64_t)(cid * 4 + kind) << 20) | p, slot);
            }
        }
        stags[p] = ((uint64_t)(4 + 1) << 44) | ((uint64_t)p << 24) | 7; /* cid 1, coll */
    }
    for (b = 0; b < 20; b++) {
        double t = now();
        for (i = 0; i < n; i++) {
            ucxcomm_count_send(s, eps[i & 3], 8, 1);
            ucxcomm_count_recv(s, stags[i & 3], 8, (int)(i & 1), 0);
        }
        t = (now() - t) / n;
        best = t < best ? t : best;
    }
    printf("%.2f %llu\n", best * 1e9,
           (unsigned long long)ucxcomm_stats_get(s, 1)->sent[UCXCOMM_STATS_ROWS].messages);
    ucxcomm_stats_free(s);
    return 0;
}
"""


def _count_cost() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        driver, exe = os.path.join(tmp, "driver.c"), os.path.join(tmp, "driver")
        with open(driver, "w") as f:
            f.write(_DRIVER)
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-std=gnu11", "-I",
                        os.path.join(HERE, "csrc"), os.path.join(HERE, "csrc", "stats.c"),
                        driver, "-o", exe], check=True)
        ns, counted = subprocess.run([exe], check=True, capture_output=True,
                                     text=True).stdout.split()
    print(f"csrc/stats.c: one counted send + one counted receive: {float(ns):.1f} ns "
          f"(best of 20 batches of 10**7; {counted} sends tallied in one row)")


def _env(tree: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=tree)
    for k in ("UCXCOMM_RANK", "UCXCOMM_SIZE", "UCXCOMM_STORE", "RANK", "WORLD_SIZE"):
        env.pop(k, None)
    return env


def _run(tree: str, what: str) -> list[float]:
    if what == "self":
        argv = [sys.executable, __file__, "--self"]
    else:
        argv = [sys.executable, "-m", "ucxcomm.cli", "run", "-n", what, "--timeout", "240",
                sys.executable, __file__, "--allreduce"]
    got = subprocess.run(argv, env=_env(tree), check=True, capture_output=True, text=True,
                         timeout=300, cwd=tree).stdout
    return [float(x) for x in got.split()[-2 if what == "self" else -1:]]


def main() -> None:
    base = os.path.abspath(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    names = {"self": ["Send + Recv to itself, 8 B, both finished in their calls",
                      "Irecv posted, Send 8 B to itself, await (a receive that waits)"],
             "2": ["Allreduce 8 B, 2 ranks"], "4": ["Allreduce 8 B, 4 ranks"]}
    rows: dict[tuple[str, str], list[list[float]]] = {}
    for i in range(rounds):
        for what in names:
            sides = (("stats", HERE), ("base", base))
            for side, tree in (sides if i % 2 == 0 else sides[::-1]):
                rows.setdefault((what, side), []).append(_run(tree, what))
    print("ns per operation (best of 20 batches; one figure per process); "
          f"this tree {HERE} against {base}")
    for what, labels in names.items():
        for col, label in enumerate(labels):
            on = [r[col] for r in rows[(what, "stats")]]
            off = [r[col] for r in rows[(what, "base")]]
            diff = min(on) - min(off)
            print(f"{label}: counters {min(on):.0f}-{max(on):.0f}, base {min(off):.0f}-"
                  f"{max(off):.0f}; best against best {diff:+.0f} ({diff / min(off):+.1%})")


if __name__ == "__main__":
    if sys.argv[1:] == ["--c"]:
        _count_cost()
    elif sys.argv[1:] == ["--self"]:
        asyncio.run(self_loops())
    elif sys.argv[1:] == ["--allreduce"]:
        asyncio.run(_allreduce_child())
    else:
        main()
