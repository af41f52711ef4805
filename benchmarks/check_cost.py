"""What collective fingerprints (``UCXCOMM_CHECK_COLLECTIVES``, docs/debugging.md) cost.

Run: ``python benchmarks/check_cost.py [ROUNDS] [--sizes 2,4] [--calls Allreduce,...]
[--json FILE]`` (``--calls``: the rows printed, by the call's name).

For each communicator size, ``ucxcomm run -n N`` starts the rank program below ROUNDS
times (default 3; ranks bound to cores where there are enough). Each job holds two
communicators over the same ranks, one with the checks on and one with them off (the
second made by ``dup`` while the world's setting is flipped on every rank at once: a
benchmark-only switch, the same on every rank, so both forms are legal), and times every
call on both, batch by batch alternated (on, off, off, on, ...): the two differ only in the
check, not in the process, its placement or its memory layout, which moved the figures
of separate jobs by more than the 2 % budget. Calls: 8 B ``Allreduce`` (the issue's
budget: at most 2 % of its time), 8 B ``Bcast``, ``Allgather``, ``Alltoall``,
``barrier``, and 64 KiB ``Bcast`` (the general form: a round of fingerprints before the
data); each as the best of 15 batches per communicator, every batch started together
(a barrier); rank 0 prints the slowest rank's best per call and form. The table gives
each call's median and minimum over the jobs, on and off, and the median of the jobs'
on/off ratios.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

CALLS = ("Allreduce 8B", "Bcast 8B", "Allgather 8B", "Alltoall 8B", "barrier", "Bcast 64KiB")


async def _rank() -> None:
    import numpy as np

    import ucxcomm

    comm = await ucxcomm.init()
    world = comm._group.world
    flag = world.check_collectives
    world.check_collectives = not flag
    other = await comm.dup()
    world.check_collectives = flag
    comms = {"1": comm, "0": other} if flag else {"1": other, "0": comm}
    p = comm.size
    a, b = np.ones(1), np.empty(1)
    g = np.empty(p)
    s, t = np.ones(p), np.empty(p)
    big = np.ones(8192)

    def calls(c):
        return {
            "Allreduce 8B": (lambda: c.Allreduce(a, b), 4000),
            "Bcast 8B": (lambda: c.Bcast(b, 0), 4000),
            "Allgather 8B": (lambda: c.Allgather(a, g), 4000),
            "Alltoall 8B": (lambda: c.Alltoall(s, t), 4000),
            "barrier": (lambda: c.barrier(), 4000),
            "Bcast 64KiB": (lambda: c.Bcast(big, 0), 500),
        }

    table = {k: calls(c) for k, c in comms.items()}
    out: dict[str, float] = {}
    wanted = os.environ.get("CHECK_COST_CALLS", ",".join(CALLS)).split(",")
    for name in CALLS:
        if name not in wanted:
            continue
        best = {"1": float("inf"), "0": float("inf")}
        for k in ("1", "0"):
            fn, n = table[k][name]
            for _ in range((n // 4) // (4 if p > 2 else 1)):
                await fn()
        for i in range(30):
            k = "10"[(i + i // 2) % 2]      # on, off, off, on, on, off, ...
            fn, n = table[k][name]
            if p > 2:
                n //= 4
            await comm.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                await fn()
            best[k] = min(best[k], (time.perf_counter() - t0) / n)
        for k in ("1", "0"):
            out[f"{name}|{k}"] = max(await comm.allgather(best[k])) * 1e6
    if comm.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    await other.close()
    await comm.close()


def _run(n: int, calls: list[str]) -> dict[str, float]:
    env = dict(os.environ, CHECK_COST_CALLS=",".join(calls))
    for k in ("UCXCOMM_RANK", "UCXCOMM_SIZE", "UCXCOMM_STORE", "RANK", "WORLD_SIZE"):
        env.pop(k, None)
    bind = ["--bind-to", "core"] if n <= (os.cpu_count() or 1) else []
    proc = subprocess.run([sys.executable, "-m", "ucxcomm.cli", "run", "-n", str(n), *bind,
                           "--timeout", "600", sys.executable, __file__, "--rank"],
                          env=env, capture_output=True, text=True, timeout=700, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"rank program failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def main() -> None:
    args = sys.argv[1:]
    if args == ["--rank"]:
        asyncio.run(_rank())
        return
    sizes, path = [2, 4], None
    if "--sizes" in args:
        i = args.index("--sizes")
        sizes = [int(x) for x in args[i + 1].split(",")]
        del args[i:i + 2]
    calls = list(CALLS)
    if "--calls" in args:
        i = args.index("--calls")
        calls = [c for c in CALLS if c.split()[0] in args[i + 1].split(",")]
        del args[i:i + 2]
    if "--json" in args:
        i = args.index("--json")
        path = args[i + 1]
        del args[i:i + 2]
    rounds = int(args[0]) if args else 3
    lines = []
    for n in sizes:
        jobs = []
        for i in range(rounds):
            got = _run(n, calls)
            jobs.append(got)
            lines.append({"ranks": n, "round": i, **got})
        bound = " (ranks bound to cores)" if n <= (os.cpu_count() or 1) else ""
        print(f"\n{n} ranks{bound}, {rounds} jobs: median (min) in us per call, the "
              "slowest rank's best batch; on/off: median (min, max) of the jobs' ratios")
        print(f"{'call':<14} {'checks on':>16} {'off':>16} {'on/off':>22}")
        for name in calls:
            on = [r[f"{name}|1"] for r in jobs]
            off = [r[f"{name}|0"] for r in jobs]
            ratio = [x / y for x, y in zip(on, off, strict=True)]
            print(f"{name:<14} {statistics.median(on):>8.2f} ({min(on):5.2f}) "
                  f"{statistics.median(off):>8.2f} ({min(off):5.2f}) "
                  f"{statistics.median(ratio):>8.3f} ({min(ratio):.3f}, {max(ratio):.3f})")
    if path:
        with open(path, "w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
